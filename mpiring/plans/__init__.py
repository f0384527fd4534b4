"""Who holds which tokens, which keys each query sees, and every strategy's schedule, as data. No MPI."""
