"""Every data plane answers the same bad request with the same status: they all run the node's one put driver
and its page-count rule (kvstore/node/drivers.py). Four planes (gRPC streams, shm, TCP, UCX), one real node
with tokens that takes MAX_PAGES pages per request, and bad Puts: an unknown target tier, a page smaller and a
page larger than the layout's, a page whose declared checksum is wrong, a read-only caller, and one page
more than the node takes. Nothing of any of them may be stored. A Get of one hash more than the node takes
is refused alike too. (A client cuts its calls to the limit a node advertises: the clients here read the node's
Stats as an older node's, which advertise none, so what reaches each plane is what the test asks for.)"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from kvstore.cli.launch import NodeProcess
from kvstore.client import KVStoreClient
from kvstore.client.planes import shm as shm_plane
from kvstore.errors import DataLoss, InvalidArgument, KVStoreError, PermissionDenied
from kvstore.names import TierKind
from kvstore.security import ClientSecurity
from kvstore.wire import PutOpen
from kvstore.wire.ucx import ucxx_installed
from tests.integration.conftest import LAYOUT, NS, PAGE, as_older_node, key, page, start_node
from tests.security.conftest import READ, WRITE, token_args

PLANES = ["grpc", "shm", "tcp", *(["ucx"] if ucxx_installed() else [])]
WRONG_CHECKSUM = 0x1234_5678
MAX_PAGES = 4  # the node's max_pages_per_request (these clients do not learn it: the node refuses more)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    tmp = tmp_path_factory.mktemp("parity")
    n = start_node(tmp, dram_pages=16, extra_args=[*token_args(tmp), *(["--ucx"] if "ucx" in PLANES else [])],
                   env={"UCX_NET_DEVICES": "lo", "KVSTORE_MAX_PAGES_PER_REQUEST": str(MAX_PAGES)})  # fmt: skip
    try:
        yield n
    finally:
        n.close()


def put(kv: KVStoreClient, op: PutOpen, hashes: list[bytes], pages: list[bytes]) -> object:
    """`op` through the client's public put (a bad field included: it is the node's to refuse)."""
    return kv.put(op.namespace, op.layout, hashes, pages, target_tier=op.target_tier, parent=op.parent, chain=op.chain)


def lying_checksums(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sending client declares a wrong checksum for every page, on every plane (the node is real)."""
    for module in ("kvstore.wire.streams", "kvstore.client.planes.tcp", "kvstore.client.planes.ucx"):
        monkeypatch.setattr(f"{module}.wire_checksum", lambda *_args: WRONG_CHECKSUM)
    honest = shm_plane.put_request

    def declared(*args: object, **kw: object) -> object:  # shm hashes as it copies: its request is rewritten
        req = honest(*args, **kw)  # type: ignore[arg-type]
        for p in req.pages:
            p.checksum = WRONG_CHECKSUM
        return req

    monkeypatch.setattr(shm_plane, "put_request", declared)


Case = Callable[[KVStoreClient, list[bytes]], object]
CASES: dict[str, tuple[str, type[KVStoreError], Case]] = {
    "target tier": (WRITE, InvalidArgument, lambda kv, hs: put(kv, PutOpen(NS, LAYOUT, 7), hs, [page(h) for h in hs])),  # type: ignore[arg-type]
    "size": (WRITE, InvalidArgument, lambda kv, hs: put(kv, PutOpen(NS, LAYOUT), hs, [page(h, PAGE // 2) for h in hs])),
    "size (larger)": (WRITE, InvalidArgument, lambda kv, hs: put(kv, PutOpen(NS, LAYOUT), hs, [page(h, PAGE * 2) for h in hs])),
    "checksum": (WRITE, DataLoss, lambda kv, hs: put(kv, PutOpen(NS, LAYOUT), hs, [page(h) for h in hs])),
    "read-only": (READ, PermissionDenied, lambda kv, hs: kv.put(NS, LAYOUT, hs, [page(h) for h in hs])),
    "page count": (WRITE, InvalidArgument, lambda kv, hs: kv.put(NS, LAYOUT, hs, [page(h) for h in hs])),
}  # fmt: skip
COUNT = {"page count": MAX_PAGES + 1}  # pages of each bad Put (3 unless named here)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("plane", PLANES)
def test_every_plane_answers_a_bad_put_alike_and_stores_nothing(
    node: NodeProcess, plane: str, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    token, expected, run = CASES[case]
    if case == "checksum":
        lying_checksums(monkeypatch)
    hashes = [key(i, f"parity-{plane}-{case}") for i in range(COUNT.get(case, 3))]
    with as_older_node(
        KVStoreClient(node.addr, timeout=20, transport=plane, security=ClientSecurity(token=token))
    ) as kv:
        with pytest.raises(expected) as err:
            run(kv, hashes)
        assert type(err.value) is expected  # the class itself, not a relative: one status per bad Put
    monkeypatch.undo()
    with KVStoreClient(node.addr, timeout=20, transport="grpc", security=ClientSecurity(token=WRITE)) as kv:
        assert kv.lookup(NS, hashes) == 0  # nothing of the refused Put is stored
        kv.put(NS, LAYOUT, hashes[:1], [page(hashes[0])], target_tier=TierKind.DRAM)  # and the node still serves
        assert [bytes(p) for p in kv.get(NS, hashes[:1])] == [page(hashes[0])]


@pytest.mark.parametrize("plane", PLANES)
def test_every_plane_refuses_a_get_over_the_page_limit_alike(node: NodeProcess, plane: str) -> None:
    hashes = [key(i, f"parity-get-{plane}") for i in range(MAX_PAGES + 1)]
    with KVStoreClient(node.addr, timeout=20, transport="grpc", security=ClientSecurity(token=WRITE)) as kv:
        kv.put(NS, LAYOUT, hashes[:MAX_PAGES], [page(h) for h in hashes[:MAX_PAGES]])  # the namespace is known
    with as_older_node(
        KVStoreClient(node.addr, timeout=20, transport=plane, security=ClientSecurity(token=READ))
    ) as kv:
        with pytest.raises(InvalidArgument) as err:
            kv.get(NS, hashes)
        assert type(err.value) is InvalidArgument and "hashes" in str(err.value)
        assert [bytes(p) for p in kv.get(NS, hashes[:MAX_PAGES])] == [page(h) for h in hashes[:MAX_PAGES]]
