"""Pure bookkeeping: slot allocator, LRU policy, page header format, layout, config."""

import pytest

from kvstore.config import NodeConfig, parse_size
from kvstore.layout import DType, PageLayout
from kvstore.pageformat import HEADER_BYTES, HeaderError, PageHeader, slot_bytes_for
from kvstore.policy import LRUPolicy, first_usable, make_policy
from kvstore.tiers.slots import SizeClassAllocator


def test_allocator_hands_out_each_slot_once() -> None:
    a = SizeClassAllocator(4, 8192)  # one size, the chunk's: a slot per chunk, as before size classes
    got = [a.allocate(8192).offset for _ in range(4)]
    assert got == [0, 8192, 16384, 24576]  # front to back
    assert not a.can_allocate(8192) and a.used_count == 4 and a.used_bytes == 4 * 8192
    with pytest.raises(MemoryError):
        a.allocate(8192)
    a.free(16384)
    assert a.allocate(8192).offset == 16384


def test_allocator_rejects_double_free_and_bad_claims() -> None:
    a = SizeClassAllocator(3, 8192)
    s = a.allocate(8192).offset
    a.free(s)
    with pytest.raises(ValueError, match="not allocated"):
        a.free(s)
    a.claim(8192, 8192)
    with pytest.raises(ValueError, match="not free"):
        a.claim(8192, 8192)
    a.claim(0, 4096)  # a free chunk takes the claimed slot's size
    with pytest.raises(ValueError, match="8192 B slots, not 4096"):
        a.claim(12288, 4096)
    with pytest.raises(ValueError, match="not a slot"):
        a.claim(5 * 8192, 8192)
    with pytest.raises(ValueError, match="multiple of 4096"):
        a.allocate(5000)
    assert a.is_allocated(8192) and a.is_allocated(0) and not a.is_allocated(4096)


def test_lru_order_and_skip() -> None:
    p = LRUPolicy()
    for k in "abcd":
        p.on_insert(k)
    p.on_access("a")
    assert list(p.candidates()) == ["b", "c", "d", "a"]
    p.on_remove("c")
    assert first_usable(p, lambda k: k != "b") == "d"
    assert first_usable(p, lambda k: False) is None
    assert len(p) == 3


def test_make_policy_names() -> None:
    assert make_policy("LRU").name == "lru"
    with pytest.raises(ValueError, match="known"):
        make_policy("nope")


def test_layout_page_bytes_and_validation() -> None:
    layout = PageLayout(DType.BFLOAT16, 32, 8, 128, 16)
    assert layout.page_bytes == 32 * 2 * 16 * 8 * 128 * 2
    assert PageLayout.unpack(layout.pack()) == layout
    assert PageLayout("fp16", 1, 1, 1, 1).dtype is DType.FLOAT16  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_layers"):
        PageLayout(DType.FLOAT16, 0, 1, 1, 1)
    with pytest.raises(ValueError, match="unknown dtype"):
        DType.parse("float64")


def test_header_round_trip_and_corruption() -> None:
    layout = PageLayout(DType.FLOAT16, 2, 2, 64, 16)
    h = PageHeader("ns/é", b"\x07" * 32, layout, layout.page_bytes, 0xDEADBEEF, 42)
    block = bytearray(h.pack())
    assert len(block) == HEADER_BYTES and PageHeader.unpack(block) == h
    block[40] ^= 1
    with pytest.raises(HeaderError, match="checksum"):
        PageHeader.unpack(block)
    with pytest.raises(HeaderError, match="no page header"):
        PageHeader.unpack(bytes(HEADER_BYTES))


def test_slot_bytes_aligned() -> None:
    assert slot_bytes_for(65536) == 4096 + 65536
    assert slot_bytes_for(1000) == 8192


def test_parse_size() -> None:
    assert parse_size("64MiB") == 64 << 20
    assert parse_size("2G") == 2_000_000_000
    assert parse_size("4096") == 4096
    assert parse_size(7) == 7
    with pytest.raises(ValueError, match="not a size"):
        parse_size("lots")


def test_config_precedence(tmp_path) -> None:  # type: ignore[no-untyped-def]
    f = tmp_path / "node.toml"
    f.write_text('[node]\ndram_bytes = "1MiB"\nport = 7000\nnode_id = "from-file"\n')
    cfg = NodeConfig.load(f, env={"KVSTORE_PORT": "7001", "KVSTORE_SPILL_ON_SHUTDOWN": "no"}, node_id="flag")
    assert (cfg.dram_bytes, cfg.port, cfg.node_id, cfg.spill_on_shutdown) == (1 << 20, 7001, "flag", False)
    f.write_text("[node]\nbogus = 1\n")
    with pytest.raises(ValueError, match="unknown config keys"):
        NodeConfig.load(f, env={})


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="nvme_path"):
        NodeConfig(nvme_bytes=1 << 20)
    with pytest.raises(ValueError, match="policy"):
        NodeConfig(policy="fifo-ish")
    with pytest.raises(ValueError, match="port"):
        NodeConfig(port=70000)
