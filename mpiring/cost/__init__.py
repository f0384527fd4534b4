"""What a plan costs: bytes, messages, memory and time, for training and inference, on one node or many. No MPI."""
