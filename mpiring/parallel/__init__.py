"""One module per strategy: how blocks, heads or queries move between the ranks, and the loop that computes on them.

``strategies`` picks the loop a plan names (``run_forward``, ``run_backward``); ``ring`` and ``backward`` are
the flat ring's loops (and the all-gather's), ``passq`` the ring that passes the queries, ``ulysses`` the
all-to-all of heads, ``double_ring`` the ring per node and across nodes, ``grid`` ring x Ulysses, ``sparse``
blocks straight to their users; ``latent``: MLA, its latent travelling; ``topk``: an indexer's top-k key blocks;
``mixing``: the sequence mixers.
No loop calls the public API and no import goes up (``tests/test_layers.py``).
"""
