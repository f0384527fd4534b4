"""One module per strategy: how blocks, heads or queries move between the ranks, and the loop that computes on them.

``run`` picks the loop a plan names (``run_forward``, ``run_backward``);
``ring`` and ``backward`` are the flat ring's loops (and the all-gather's),
``passq`` the ring that passes the queries, ``ulysses`` the all-to-all of
heads, ``double_ring`` the ring per node and across nodes, ``grid`` ring x
Ulysses.

No loop calls the public API and no import goes up: the grid composes
Ulysses' all-to-alls (``ulysses``) with the loop ``run`` hands it for the
ring across its groups, on its own communicators (``tests/test_layers.py``).
"""
