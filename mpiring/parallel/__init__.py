"""One module per strategy: how blocks, heads or queries move between the ranks, and the loop that computes on them.

``run`` picks the loop a plan names (``run_forward``, ``run_backward``);
``ring`` and ``backward`` are the flat ring's loops (and the all-gather's),
``passq`` the ring that passes the queries, ``ulysses`` the all-to-all of
heads, ``double_ring`` the ring per node and across nodes, ``grid`` ring x
Ulysses.

One import goes up, the only one in the package: ``grid.hybrid_forward`` and
``grid.hybrid_backward`` run the ring across the Ulysses groups by calling
the public ``mpiring.handle.ring_attention`` (``ring_attention_backward``)
on the cross communicator, imported inside those two functions.
``tests/test_layers.py`` allows exactly these two imports; a loop composed
from ``ring``'s own would remove them.
"""
