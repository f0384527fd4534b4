"""One module per strategy: how blocks, heads or queries move between the ranks, and the loop that computes on them."""
