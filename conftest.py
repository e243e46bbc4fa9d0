"""The repository's root conftest: headwater's pytest plugin for every test here.

The plugin is registered by its ``pytest11`` entry point once headwater is installed;
naming it here too makes a checkout whose installed metadata predates it (or that is
only on ``PYTHONPATH``) load it as well. pytest loads a plugin once by name either way.
"""

pytest_plugins = ["headwater.testing.plugin"]
