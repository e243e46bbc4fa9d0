"""Local supervisors: child processes, the programs of a cluster, ``headwater launch``
and ``headwater serve --processes N``. Top layer, with :mod:`headwater.cli`."""
