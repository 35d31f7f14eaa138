"""PromptQueue bookkeeping (no Kafka): bound and shares, oldest admissible group first, offset order
within a partition, dropping partitions."""

from producers.prompt_queue import PromptQueue

A, B, C = ("p", 0), ("p", 1), ("p", 2)


def prompt(g, n=2):
    return {"group_seq": g, "sample_count": n}


def test_room_and_shares_follow_the_limit():
    q = PromptQueue(limit=8)
    assert not q and q.room(2) == 4 and q.full([A, B]) == set()
    q.push(A, 0, prompt(5), 0)
    q.push(A, 1, prompt(6), 0)
    assert q.samples() == q.samples(A) == 4 and q.samples(B) == 0 and len(q) == 2
    assert q.full([A, B]) == {A}  # A holds its share (8 / 2); B, with nothing queued, keeps fetching
    assert q.full([A, B, C, ("p", 3)]) == {A}
    assert q.room(2) == 2 and q.room(3) == 2  # ceil(4 / 3)
    q.push(B, 0, prompt(1, n=6), 0)
    assert q.room(2) == 0 and q.full([A, B]) == {A, B}


def test_the_oldest_admissible_head_goes_first_and_partitions_keep_their_order():
    q = PromptQueue(limit=100)
    q.push(A, 10, prompt(4), 0)
    q.push(A, 11, prompt(2), 0)  # behind 4 on its partition: not before it
    q.push(B, 7, prompt(3), 1)
    q.push(C, 1, prompt(9), 0)
    admissible = lambda p: p["group_seq"] < 9  # noqa: E731
    assert q.waiting(admissible) == 1  # C's head (9) may not start yet
    order = []
    while (got := q.pop_oldest(admissible)) is not None:
        tp, (offset, p, gen) = got
        order.append((tp, offset, p["group_seq"], gen))
    assert order == [(B, 7, 3, 1), (A, 10, 4, 0), (A, 11, 2, 0)]
    assert q.heads() == [prompt(9)] and len(q) == 1  # the inadmissible one stays


def test_drop_forgets_only_the_matching_partitions():
    q = PromptQueue(limit=10)
    for tp in (A, B, C):
        q.push(tp, 0, prompt(0), 0)
    q.drop(lambda tp: tp in {A, C})
    assert q.samples() == q.samples(B) == 2 and q.samples(A) == 0
    q.drop(lambda tp: True)
    assert not q and q.samples() == 0
