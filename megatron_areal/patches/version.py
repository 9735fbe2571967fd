"""The megatron-core release every change under ``megatron_areal/patches/`` is written against: the one pin.

``setup.py`` reads the assignment below as text (installing must not import the package), the upstream
check (``upstream.py``) and the CPU redirect (``cpu_gloo.py``) import it. To upgrade, change it here and
follow ``patches/README.md``.
"""
MEGATRON_CORE_VERSION = "0.16.1"
