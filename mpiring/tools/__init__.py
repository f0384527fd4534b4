"""Tools built on mpiring (the grader and the deadlock demo among them)."""
