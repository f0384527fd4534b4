"""The sequence mixers that are not attention: short convolutions and linear recurrences, in NumPy. No MPI."""
