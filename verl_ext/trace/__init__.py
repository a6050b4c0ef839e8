"""The per-token trace: capture (tensors -> Arrow), background writer, reader.

* :mod:`verl_ext.trace.schema`: the format (layout, columns, run record keys), a public contract
* :mod:`verl_ext.trace.capture`: ``StepCapture``, what the trainer hands over, and its conversion
* :mod:`verl_ext.trace.writer`: ``TraceWriter``, the bounded queue and the writer thread
* :mod:`verl_ext.trace.reader`: ``open_trace`` and ``Trace``
* :mod:`verl_ext.trace.storage`, :mod:`verl_ext.trace.record`: filesystems, atomic files, ``_run.json``

Nothing is imported here, so that reading a trace does not import torch.
"""
