"""The suite's infrastructure, not tests: the fork server the interpreters it starts run in
(``forkserver``), Hydra's YAML files parsed once (``config_cache``), trainer runs shared between
tests (``shared_runs``), an isolated estimator registry (``registry_helpers``), the definitions as
direct sums (``reference``), reduced-precision matrix products on a CPU (``reduced_precision``) and
the scan of references to sections of the docs (``doc_references``)."""
