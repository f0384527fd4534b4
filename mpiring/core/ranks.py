"""Rank sets as text, compact at any number of ranks: ranks 0-3, 5, 7-9 rather than every rank one by one."""

__all__ = ["ranks_text"]


def ranks_text(ranks, noun="rank"):
    """``ranks`` (any iterable of ints; repeats count once) as "rank 3", "ranks 0, 1" or "ranks 0-63, 70".

    Runs of three or more consecutive ranks read as ``first-last``; ``noun``
    names them ("root rank", "node"): a plural "s" is added for more than one.
    """
    ranks = sorted({int(r) for r in ranks})
    parts, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts += [f"{ranks[i]}-{ranks[j]}"] if j - i >= 2 else [str(r) for r in ranks[i:j + 1]]
        i = j + 1
    return f"{noun}{'s' if len(ranks) > 1 else ''} {', '.join(parts)}"
