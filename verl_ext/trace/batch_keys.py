"""The keys under which the trace's values travel through verl: in the trainer's batch, on each
mini-batch, and in an update's metrics. The trainer's side (:mod:`verl_ext.integration.step`) and the
workers' side (:mod:`verl_ext.integration.update_hook`) both name them from here."""

#: (B,) int64 tensor in the batch: the sample's row in the trainer's batch (the token table's ``sample``),
#: -1 for a row the trace does not keep. A batch that carries it asks the workers for their reports.
ROW_KEY = "verl_ext_row"
#: Non-tensor values put on each mini-batch of a traced update: its PPO epoch and its index in the epoch.
EPOCH_KEY, MINIBATCH_KEY = "verl_ext_epoch", "verl_ext_minibatch"
#: Key of the workers' per-token reports in an update's metrics (verl's trainer prefixes "actor/" or "critic/").
PAYLOAD_KEY = "verl_ext/update"
#: (B, T) int64 tensor in a batch ``verl-ext replay`` rebuilt from a V1 run: the loss mask verl's V1 trainer
#: divided the loss by (the policy's tokens, a rejected one with the kept), where verl's conversion of the batch
#: takes the response mask (verl_ext.integration.patches.wrap_left_right_2_no_padding).
LOSS_MASK_KEY = "verl_ext_loss_mask"
