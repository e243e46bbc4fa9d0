"""The repository's root conftest: the pytest plugins every test here may use.

headwater's own (``headwater.testing.plugin``) is registered by its ``pytest11`` entry
point once headwater is installed; naming it here too makes a checkout whose installed
metadata predates it (or that is only on ``PYTHONPATH``) load it as well: pytest loads
a plugin once by name either way. ``pytester`` runs users' test files in the plugin's
own tests (tests/test_testing_plugin.py).
"""

pytest_plugins = ["headwater.testing.plugin", "pytester"]
