"""One rank's compute: the kernels, their tiles and GEMMs, one block into the running result, the references. No MPI."""
