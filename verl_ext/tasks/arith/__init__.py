"""The example task of the CPU backend: "请问a+b=c？" -> "是的，等于c！" or "不，等于a+b！".

The prompts (:mod:`.task`), the rule-based reward verl loads by path (:mod:`.reward`), the
supervised warm start (:mod:`.warm_start`), the critic's value pretraining
(:mod:`.value_pretraining`) and the cached assets that bundle them (:mod:`.assets`). Nothing here is
imported by verl-ext's plugin or by its CPU backend; a new task is a sibling package with the same
kind of assets (paths of a model, prompts and a reward function, see
:class:`verl_ext.cpu.overrides.RunAssets`) and one record in :data:`verl_ext.tasks.TASKS`.
"""
