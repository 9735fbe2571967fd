"""What the processes of one run share, on the filesystem every node sees: the launcher's plan (``plan``),
server registration (``registry``), requests to the trainer (``control``), the API key's passage by
environment (``secrets``) and the error a failed start raises (``errors``). The run directory's layout, and
the records a run writes into it, are ``megatron_areal/rundir/``.

The launcher (``launch/``) writes these and the trainer (``trainer/``) reads them; both depend on this
package and neither on the other, so ``launch/`` is imported only by the command line
(``tests/test_import_graph.py``).
"""
