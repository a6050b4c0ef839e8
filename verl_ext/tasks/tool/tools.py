"""The file verl loads by path (``actor_rollout_ref.rollout.multi_turn.function_tool_path``).

It registers the calculator as a verl ``FunctionTool`` and holds nothing else: verl's registry
refuses a second, different function object under one name, so the function lives in an importable
module (:mod:`verl_ext.tasks.tool.calculator`) and this file registers that same object however
often it is loaded.
"""

from verl.tools.function_tool import function_tool

from verl_ext.tasks.tool.calculator import add

function_tool(add)
