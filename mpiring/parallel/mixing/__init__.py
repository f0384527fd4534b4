"""The sequence mixers under MPI: the call and its agreement, state passing, convolution halos, entry points."""
