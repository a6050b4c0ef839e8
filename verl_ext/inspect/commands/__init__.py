"""The ``verl-ext check | show | summary | plot`` subcommands (see :mod:`verl_ext.cli`)."""
