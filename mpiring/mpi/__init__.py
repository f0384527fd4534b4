"""The MPI layer, below every strategy: the ring's communicator, waits, collectives and agreement.

Every module here uses MPI. What each rank checks alone is ``plans.checks``;
receive slots are ``core.buffers``; what a rank did is ``core.record``.
"""
