"""The RRef protocol's bookkeeping, driven with plain events: no processes, no I/O.

Workers are ranks: 0 owns the values, 1 and 2 are users. A test plays the
messages each worker would send (the `Send` actions) into the other workers'
tables, in the orders the network may deliver them.
"""

import pytest

from rrpc.messages import RREF_ACCEPT, RREF_DELETE, RREF_FORK
from rrpc.rref_protocol import (
    CONFIRMED,
    FAILED,
    FAILED_KEPT,
    OwnerTable,
    ProtocolError,
    Send,
    UserTable,
)

OWNER, ALICE, BOB = 0, 1, 2
RREF = (ALICE, 1)  # created by Alice's remote()
ALICE_FORK = (ALICE, 2)
BOB_FORK = (ALICE, 3)  # Alice pickles her RRef for Bob: the child's id is hers


def make_owner() -> OwnerTable:
    def make_holder(rref_id, failed):
        return f"value of {rref_id}" if failed is None else f"{failed} {rref_id}"

    return OwnerTable(OWNER, make_holder)


def alice_created_and_confirmed(owner: OwnerTable) -> UserTable:
    alice = UserTable(ALICE)
    alice.created(RREF, ALICE_FORK, OWNER)
    assert owner.create(RREF, ALICE_FORK) == f"value of {RREF}"
    assert alice.confirmed(ALICE_FORK) == []
    return alice


# -- Creation and deletion -----------------------------------------------------
def test_remote_counts_the_creators_fork_and_its_drop_deletes_the_value():
    owner = make_owner()
    alice = alice_created_and_confirmed(owner)
    assert owner.entries[RREF].forks == {ALICE_FORK}
    sends = alice.dropped(ALICE_FORK)
    assert sends == [Send(RREF_DELETE, OWNER, (RREF, ALICE_FORK))]
    assert alice.forks == {}
    assert owner.delete(RREF, ALICE_FORK) == f"value of {RREF}"
    assert owner.entries == {}


def test_a_fork_dropped_before_the_owner_confirms_it_waits_for_the_confirmation():
    owner = make_owner()
    alice = UserTable(ALICE)
    alice.created(RREF, ALICE_FORK, OWNER)
    assert alice.dropped(ALICE_FORK) == []  # a DELETE now could overtake the CREATE
    assert alice.counts()["num_pending_confirmations"] == 1
    owner.create(RREF, ALICE_FORK)
    assert alice.confirmed(ALICE_FORK) == [Send(RREF_DELETE, OWNER, (RREF, ALICE_FORK))]
    assert owner.delete(RREF, ALICE_FORK) is not None
    assert owner.entries == {} and alice.forks == {}


def test_a_refused_create_is_forgotten_without_a_delete():
    alice = UserTable(ALICE)
    alice.created(RREF, ALICE_FORK, OWNER)
    assert alice.confirmed(ALICE_FORK, counted=False) == []
    assert alice.state(ALICE_FORK) == FAILED
    assert alice.dropped(ALICE_FORK) == []
    assert alice.forks == {}


# -- Forks between users -------------------------------------------------------
def test_fork_to_third_worker_keeps_value_alive_until_all_drop():
    owner = make_owner()
    alice = alice_created_and_confirmed(owner)
    bob = UserTable(BOB)

    alice.fork_child(ALICE_FORK, BOB_FORK)  # Alice pickles her RRef for Bob
    # Alice drops hers while the copy is in flight: she must not delete yet.
    assert alice.dropped(ALICE_FORK) == []
    assert alice.counts()["num_pending_children"] == 1

    fork_request = bob.received(RREF, BOB_FORK, OWNER, parent=ALICE)
    assert fork_request == [Send(RREF_FORK, OWNER, (RREF, BOB_FORK))]
    owner.fork_request(RREF, BOB_FORK)
    assert owner.entries[RREF].forks == {ALICE_FORK, BOB_FORK}

    accept = bob.confirmed(BOB_FORK)
    assert accept == [Send(RREF_ACCEPT, ALICE, (BOB_FORK,))]
    assert alice.child_accepted(BOB_FORK) == [Send(RREF_DELETE, OWNER, (RREF, ALICE_FORK))]
    assert owner.delete(RREF, ALICE_FORK) is None  # Bob still refers to it
    assert owner.entries[RREF].forks == {BOB_FORK}

    assert bob.dropped(BOB_FORK) == [Send(RREF_DELETE, OWNER, (RREF, BOB_FORK))]
    assert owner.delete(RREF, BOB_FORK) == f"value of {RREF}"
    assert owner.entries == {} and alice.forks == {} and bob.forks == {}


def test_fork_request_overtaking_the_create_makes_a_placeholder_the_create_fills():
    owner = make_owner()
    alice = UserTable(ALICE)
    bob = UserTable(BOB)
    alice.created(RREF, ALICE_FORK, OWNER)
    alice.fork_child(ALICE_FORK, BOB_FORK)
    bob.received(RREF, BOB_FORK, OWNER, parent=ALICE)
    owner.fork_request(RREF, BOB_FORK)  # Bob's FORK runs before Alice's CREATE
    assert owner.entries[RREF].awaiting_create
    assert owner.delete(RREF, BOB_FORK) is None  # awaiting its CREATE: not freed
    holder = owner.create(RREF, ALICE_FORK)
    assert holder == f"value of {RREF}" and not owner.entries[RREF].awaiting_create
    assert owner.delete(RREF, ALICE_FORK) == holder
    assert owner.entries == {}


def test_fork_of_a_fork_is_covered_by_each_parent_in_turn():
    owner = make_owner()
    alice = alice_created_and_confirmed(owner)
    bob, carol = UserTable(BOB), UserTable(3)
    carol_fork = (BOB, 1)
    alice.fork_child(ALICE_FORK, BOB_FORK)
    owner.fork_request(RREF, BOB_FORK)
    for send in bob.received(RREF, BOB_FORK, OWNER, parent=ALICE):
        assert send.kind == RREF_FORK
    bob.fork_child(BOB_FORK, carol_fork)  # Bob passes it on before his own is confirmed
    assert alice.dropped(ALICE_FORK) == []
    assert bob.dropped(BOB_FORK) == []
    assert carol.received(RREF, carol_fork, OWNER, parent=BOB)[0].kind == RREF_FORK
    assert bob.confirmed(BOB_FORK) == [Send(RREF_ACCEPT, ALICE, (BOB_FORK,))]
    assert alice.child_accepted(BOB_FORK) == [Send(RREF_DELETE, OWNER, (RREF, ALICE_FORK))]
    owner.delete(RREF, ALICE_FORK)
    owner.fork_request(RREF, carol_fork)
    assert carol.confirmed(carol_fork) == [Send(RREF_ACCEPT, BOB, (carol_fork,))]
    assert bob.child_accepted(carol_fork) == [Send(RREF_DELETE, OWNER, (RREF, BOB_FORK))]
    assert owner.delete(RREF, BOB_FORK) is None
    assert owner.entries[RREF].forks == {carol_fork}


def test_children_sent_to_a_worker_that_is_gone_release_their_parent():
    owner = make_owner()
    alice = alice_created_and_confirmed(owner)
    carol_fork = (ALICE, 4)
    alice.fork_child(ALICE_FORK, BOB_FORK, to=BOB)  # Bob dies before he unpickles it
    alice.fork_child(ALICE_FORK, carol_fork, to=3)
    assert alice.dropped(ALICE_FORK) == []  # two children pending
    assert alice.children_lost(BOB) == []  # Carol's still is
    assert alice.children_lost(BOB) == []  # nothing more sent to Bob
    assert alice.child_accepted(carol_fork) == [Send(RREF_DELETE, OWNER, (RREF, ALICE_FORK))]
    assert alice.counts()["num_pending_children"] == 0 and alice.forks == {}
    # Bob was alive after all: his ACCEPT of the child settled as lost is no error, once.
    assert alice.child_accepted(BOB_FORK) == []
    with pytest.raises(ProtocolError, match="ACCEPT of child"):
        alice.child_accepted(BOB_FORK)


def test_a_fork_the_owner_could_not_count_still_releases_its_parent():
    owner = make_owner()
    alice = alice_created_and_confirmed(owner)
    bob = UserTable(BOB)
    alice.fork_child(ALICE_FORK, BOB_FORK)
    bob.received(RREF, BOB_FORK, OWNER, parent=ALICE)
    assert bob.confirmed(BOB_FORK, counted=False) == [Send(RREF_ACCEPT, ALICE, (BOB_FORK,))]
    assert bob.dropped(BOB_FORK) == []  # never counted: nothing to delete
    assert bob.forks == {}


def test_a_fork_to_oneself_is_accepted_without_a_message():
    owner = make_owner()
    alice = alice_created_and_confirmed(owner)
    self_fork = (ALICE, 9)
    alice.fork_child(ALICE_FORK, self_fork)
    assert alice.received(RREF, self_fork, OWNER, parent=ALICE) == [
        Send(RREF_FORK, OWNER, (RREF, self_fork))
    ]
    owner.fork_request(RREF, self_fork)
    assert alice.confirmed(self_fork) == []  # the ACCEPT is applied locally
    assert alice.counts()["num_pending_children"] == 0


def test_discarding_a_pickled_fork_releases_the_parent():
    owner = make_owner()
    alice = alice_created_and_confirmed(owner)
    alice.fork_child(ALICE_FORK, BOB_FORK)
    alice.dropped(ALICE_FORK)
    assert alice.child_accepted(BOB_FORK) == [Send(RREF_DELETE, OWNER, (RREF, ALICE_FORK))]


# -- The owner's own RRef ------------------------------------------------------
def test_owner_forks_are_counted_at_once_and_need_no_fork_request():
    owner = make_owner()
    bob = UserTable(BOB)
    mine, for_bob = (OWNER, 1), (OWNER, 2)
    owner.fork_to_user(mine, for_bob, "the owner RRef")
    assert owner.entries[mine].forks == {for_bob}
    assert bob.received(mine, for_bob, OWNER, parent=OWNER) == []
    assert bob.state(for_bob) == CONFIRMED
    assert bob.dropped(for_bob) == [Send(RREF_DELETE, OWNER, (mine, for_bob))]
    assert owner.delete(mine, for_bob) == "the owner RRef"
    assert owner.entries == {}


def test_rref_sent_back_to_its_owner_is_the_owners_object_and_releases_the_sender():
    owner = make_owner()
    alice = alice_created_and_confirmed(owner)
    phantom = (ALICE, 7)
    alice.fork_child(ALICE_FORK, phantom)
    holder, sends = owner.receive(RREF, phantom, parent=ALICE)
    assert holder == f"value of {RREF}"
    assert sends == [Send(RREF_ACCEPT, ALICE, (phantom,))]
    assert owner.entries[RREF].forks == {ALICE_FORK}  # the owner does not count itself
    assert alice.child_accepted(phantom) == []


def test_rref_the_owner_sends_to_itself_uncounts_its_fork_on_arrival():
    owner = make_owner()
    mine, to_self = (OWNER, 1), (OWNER, 2)
    owner.fork_to_user(mine, to_self, "the owner RRef")
    holder, sends = owner.receive(mine, to_self, parent=OWNER)
    assert (holder, sends) == ("the owner RRef", [])
    assert owner.entries == {}


# -- Wrong events --------------------------------------------------------------
def test_delete_of_a_fork_the_owner_never_counted_is_a_protocol_error():
    owner = make_owner()
    with pytest.raises(ProtocolError, match="DELETE of fork 1:2 of RRef 1:1"):
        owner.delete(RREF, ALICE_FORK)


def test_unknown_id_of_the_owners_own_is_an_error_not_a_placeholder():
    owner = make_owner()
    with pytest.raises(ProtocolError, match="RRef 0:5, which worker 0 created"):
        owner.fetch((OWNER, 5))
    assert owner.entries == {}


def test_duplicate_create_and_double_confirmation_are_protocol_errors():
    owner = make_owner()
    alice = alice_created_and_confirmed(owner)
    with pytest.raises(ProtocolError, match="CREATE of RRef 1:1, which exists already"):
        owner.create(RREF, ALICE_FORK)
    with pytest.raises(ProtocolError, match="which is confirmed"):
        alice.confirmed(ALICE_FORK)


def test_creation_failure_fails_and_releases_a_placeholder_nobody_counts():
    owner = make_owner()
    owner.fetch(RREF)  # a to_here() that overtook a CREATE that will never run
    assert owner.creation_failed(RREF, "refused") == f"value of {RREF}"
    assert owner.entries == {}


def test_a_fork_or_fetch_after_a_creation_failed_gets_a_holder_failed_already():
    owner = make_owner()
    assert owner.creation_failed(RREF, "refused") is None  # nothing overtook it
    # Alice passed her RRef to Bob before the CREATE failed; his FORK comes after.
    owner.fork_request(RREF, BOB_FORK)
    assert owner.entries[RREF].holder == f"refused {RREF}"
    assert not owner.entries[RREF].awaiting_create  # no CREATE will fill it
    assert owner.fetch(RREF) == f"refused {RREF}"
    assert owner.delete(RREF, BOB_FORK) == f"refused {RREF}"  # his drop frees it
    assert owner.entries == {}
    # A FETCH, or a receipt from a user, counts no fork: nothing is kept for it.
    assert owner.fetch(RREF) == f"refused {RREF}"
    assert owner.receive(RREF, BOB_FORK, BOB) == (
        f"refused {RREF}",
        [Send(RREF_ACCEPT, BOB, (BOB_FORK,))],
    )
    assert owner.entries == {}


def test_an_owner_remembers_only_the_latest_failed_creations():
    owner = make_owner()
    for counter in range(FAILED_KEPT + 10):
        owner.creation_failed((ALICE, counter), "refused")
    assert len(owner.failed) == FAILED_KEPT
    assert (ALICE, 9) not in owner.failed and (ALICE, 10) in owner.failed
    assert owner.fetch((ALICE, 9)) == f"value of {(ALICE, 9)}"  # a placeholder, as before
