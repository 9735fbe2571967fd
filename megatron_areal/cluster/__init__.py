"""The machines a run is placed on: the ``cluster:`` section (``config``), published GPU and network peaks
(``hardware``) and what the cluster simulator assumes beyond the run's own settings (``sim_config``, the
``sim:`` section).

These sections sit below the configuration tree (``megatron_areal/config.py`` assembles them) while their
readers, the launcher and the simulator, sit above it and read the whole tree; keeping the sections here is
what keeps the package graph free of cycles (``tests/test_import_graph.py``).
"""
