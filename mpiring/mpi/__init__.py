"""The MPI layer, below every strategy: the ring's communicator, waits, collectives, agreement, and the Record.

``checks`` (what each rank checks alone), ``buffers`` (receive slots) and
``record`` (what a rank did) import no MPI; they live here because the calls
over MPI are what use them (the simulator fills a Record too).
"""
