"""Everything that talks to MPI but runs no strategy: the ring's communicator, waits, collectives, agreement."""
