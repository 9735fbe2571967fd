"""Every change this package makes to third-party behaviour, in one index (``upstream.CHANGES``).

Each change names the upstream distribution and the version it is written against, why it exists, the
module that applies it, and the facts about the pinned upstream's source it relies on. ``check`` reads
the installed upstream's files and names every fact that no longer holds, so an upgrade that moves a
patched site fails loudly (tests/test_upstream_changes.py) instead of running unpatched code. The
human-readable index is ``patches/README.md`` at the repository's root.
"""
