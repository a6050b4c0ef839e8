"""The per-token trace: capture (tensors -> Arrow), background writer, reader.

* :mod:`verl_ext.trace.schema`: the format (layout, columns, run record keys), a public contract
* :mod:`verl_ext.trace.capture`: ``StepCapture``, what the trainer hands over, and the training
  thread's copy of it (memory from :mod:`verl_ext.trace.snapshot_memory`)
* :mod:`verl_ext.trace.step_files`, :mod:`verl_ext.trace.update_files`: a step's token and prompt
  tables, its update tables (``UpdateCapture``), made on the writer thread
* :mod:`verl_ext.trace.batch_keys`: the keys the trace's values travel under through verl
* :mod:`verl_ext.trace.writer`: ``TraceWriter``, the bounded queue and the writer thread
* :mod:`verl_ext.trace.reader`: ``open_trace`` and ``Trace``
* :mod:`verl_ext.trace.storage`, :mod:`verl_ext.trace.record`: filesystems, atomic files, ``_run.json``

Nothing is imported here, so that reading a trace does not import torch.
"""
