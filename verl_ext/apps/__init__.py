"""Applications on top of the CPU backend and the example task: one learning run
(:mod:`.learning`), ``verl-ext demo`` (:mod:`.demo`), ``verl-ext study`` (:mod:`.study`), the
overrides of a shell run (:mod:`.overrides`) and readable progress of a trainer's output
(:mod:`.progress`). They call the inspection (:mod:`verl_ext.inspect`) and the view directly, never
the CLI; the CLI calls them.
"""
