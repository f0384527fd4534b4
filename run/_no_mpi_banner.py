"""pytest plugin for run/test's mpiexec runs: no "MPI Information" section at the end.

pytest-mpi prints the MPI library's banner after every run with --with-mpi;
run/test's serial run shows it once, and the runs under mpiexec -n 2, 3 and 4
load this plugin (``-p _no_mpi_banner``, run/ on PYTHONPATH) to leave it out.
Only the banner goes: pytest-mpi's markers, min_size skips and fixtures stay.
"""

import pytest


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    # pytest-mpi's plugin object decides in its own pytest_configure (which has run
    # by now) whether to print the banner; its other hooks do not read this flag
    for plugin in config.pluginmanager.get_plugins():
        if type(plugin).__name__ == "MPIPlugin" and hasattr(plugin, "_is_testing_mpi"):
            plugin._is_testing_mpi = False
