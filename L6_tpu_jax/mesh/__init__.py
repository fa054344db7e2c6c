"""L6 over a device mesh and across hosts, kept apart from the lesson: a wing beside it, as L4's ``fast/`` is.

Optional: the lesson's engine (``../engine.py``) runs on one device without it and imports nothing of
it. ``lessons/diffs/L6_mesh.diff`` is ``engine.py`` here against ``../engine.py``, then the two files
only the mesh uses, whole.

    engine       ``MeshEngine``: ``../engine.py`` changed for a mesh with one axis, ``data``, every
                 device holding an equal share of the slots and of the KV pages (``SPECS``)
    tables       ``../page_table.py``'s functions run once per device's share of the pool
    multihost    the mesh across hosts: ``data_mesh``, reading replicated state (``local_copy``) and
                 the same-call guard (``check_same_call``)

``../l6_multihost.py``, the stage's second script, runs ``MeshEngine`` as several JAX processes.

Left out on purpose: sharding heads over a ``model`` axis (the chapter, section 12).
"""
