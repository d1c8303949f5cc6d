"""What the service reports about itself: Stats (every StatsReply field) and the pool snapshot
the dashboard draws (PoolSnapshot: one ChainSnapshot per chain)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from minipaged import wire
from minipaged.v1 import metadata_pb2 as pb


def plain_dict(msg) -> dict:
    """A message's fields as Python values, every field present (MessageToDict writes int64 as JSON
    strings: a chain's `steps` was '1262' beside an int `used_blocks`)."""
    out = {}
    for f in msg.DESCRIPTOR.fields:
        value = getattr(msg, f.name)
        repeated = f.is_repeated if hasattr(f, "is_repeated") else f.label == f.LABEL_REPEATED
        if f.message_type is not None:
            value = [plain_dict(m) for m in value] if repeated else plain_dict(value)
        elif repeated:
            value = list(value)
        out[f.name] = value
    return out


@dataclass
class Stats:
    """Every StatsReply field, by the proto's names (tests check none is missing)."""
    num_blocks: int = 0
    block_size: int = 0
    used_blocks: int = 0
    free_blocks: int = 0
    cached_blocks: int = 0
    internal_fragmentation_tokens: int = 0
    kv_utilization: float = 0.0
    running: int = 0
    waiting: int = 0
    preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_hit_rate: float = 0.0
    invariants_ok: bool = False
    steps: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    tokens_per_second: float = 0.0
    metadata_ms_per_step: float = 0.0
    num_workers: int = 0
    ready: bool = False
    cache_epoch: int = 0
    live_sequences: int = 0
    shared_blocks: int = 0
    not_ready_reason: str = ""
    chains: list = field(default_factory=list)   # one dict per replica chain (ChainStats fields)
    num_chains: int = 0
    standby_workers: int = 0
    metadata_cpu_seconds: float = 0.0
    model: str = ""
    max_model_len: int = 0
    model_fingerprint: str = ""
    model_shape: str = ""
    tier_blocks: int = 0               # the second KV tier (every chain): slots,
    tier_used_blocks: int = 0          # slots holding a block,
    tier_queries: int = 0              # prompt blocks looked up past the device prefix,
    tier_hits: int = 0                 # and loaded instead of recomputed,
    tier_saved_blocks: int = 0         # blocks saved,
    tier_loaded_blocks: int = 0        # blocks loaded,
    tier_block_bytes: int = 0          # bytes a block moves (bytes moved = blocks x this)
    kv_moves: int = 0                  # prefill -> decode moves (worker --role), every chain,
    kv_moved_blocks: int = 0           # the blocks they moved,
    kv_move_failures: int = 0          # and moves that failed (those prompts recomputed)
    max_waiting: int = 0               # --max-waiting: a call with more requests is refused
    block_api_blocks: int = 0          # the block API's own pool,
    block_api_used_blocks: int = 0     # and the blocks its callers hold

    @classmethod
    def from_proto(cls, r: pb.StatsReply) -> "Stats":
        kw = {f.name: getattr(r, f.name) for f in fields(cls) if f.name != "chains"}
        kw["chains"] = [plain_dict(c) for c in r.chains]
        return cls(**kw)

    def as_dict(self) -> dict:
        return asdict(self)

    def __getitem__(self, key: str):  # dict-like access: stats["free_blocks"]
        if key not in self.__dataclass_fields__:
            raise KeyError(key)
        return getattr(self, key)

    def keys(self):
        return self.as_dict().keys()

    def table(self) -> str:
        """A human table grouped the way an operator reads it (pool, fragmentation, queue, ...)."""
        s = self
        rows = [
            ("blocks used / free / cached", f"{s.used_blocks} / {s.free_blocks} / {s.cached_blocks}"
                                            f"  (of {s.num_blocks}, block_size {s.block_size})"),
            ("internal fragmentation", f"{s.internal_fragmentation_tokens} tokens"),
            ("KV utilization", f"{s.kv_utilization:.1%}"),
            ("running / waiting / live seqs", f"{s.running} / {s.waiting} / {s.live_sequences}"),
            ("preemptions", str(s.preemptions)),
            ("prefix cache hits", f"{s.prefix_cache_hits} / {s.prefix_cache_queries} blocks"
                                  f"  ({s.prefix_cache_hit_rate:.1%})"),
        ]
        if s.tier_blocks:
            mib = s.tier_block_bytes / 2**20
            rows += [("KV tier used / slots", f"{s.tier_used_blocks} / {s.tier_blocks} blocks"),
                     ("KV tier hits", f"{s.tier_hits} / {s.tier_queries} blocks; saved {s.tier_saved_blocks} "
                                      f"({s.tier_saved_blocks * mib:.1f} MiB), loaded {s.tier_loaded_blocks} "
                                      f"({s.tier_loaded_blocks * mib:.1f} MiB)")]
        if any(c.get("role", "both") != "both" for c in s.chains):   # disaggregated: which chain does what
            rows.append(("chains (role)", ", ".join(f"{c.get('chain_id')} {c.get('role')}" for c in s.chains)))
        if s.kv_moves or s.kv_move_failures:
            mib = s.tier_block_bytes / 2**20
            rows.append(("prefill -> decode moves", f"{s.kv_moves} ({s.kv_moved_blocks} blocks, "
                                                   f"{s.kv_moved_blocks * mib:.1f} MiB), {s.kv_move_failures} failed"))
        rows += [
            ("steps", str(s.steps)),
            ("prompt / generated tokens", f"{s.prompt_tokens} / {s.generated_tokens}"),
            ("tokens/s", f"{s.tokens_per_second:.1f}"),
            ("metadata ms/step", f"{s.metadata_ms_per_step:.3f}"),
            ("workers / ready / cache epoch", f"{s.num_workers} / {s.ready} / {s.cache_epoch}"),
            ("invariants_ok", str(s.invariants_ok)),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


@dataclass
class SequenceSnapshot:
    sequence_id: int
    state: str                 # "running" | "waiting"
    length: int
    num_blocks: int
    block_table: list[int]     # the first <= 64 blocks of its table
    num_cached_tokens: int
    label: str


@dataclass
class ChainSnapshot:
    """One chain's pool: block_state[i] (0 free, 1 owned, 2 shared, 3 cached) describes physical
    block i * stride; the counts are exact over the whole pool."""
    chain_id: int
    num_blocks: int
    block_size: int
    stride: int
    block_state: list[int]
    ref_counts: list[int]
    free_blocks: int
    owned_blocks: int
    shared_blocks: int
    cached_blocks: int
    sequences: list[SequenceSnapshot]
    running: int
    waiting: int


@dataclass
class PoolSnapshot:
    chains: list[ChainSnapshot]
    time: float

    def as_dict(self) -> dict:
        return asdict(self)


def pool_snapshot_from_proto(r: pb.PoolSnapshotReply) -> PoolSnapshot:
    chains = []
    for c in r.chains:
        seqs = [SequenceSnapshot(s.sequence_id, s.state, s.length, s.num_blocks,
                                 wire.unpack(s.block_table, wire.INT32, name="block_table").tolist(),
                                 s.num_cached_tokens, s.label) for s in c.sequences]
        chains.append(ChainSnapshot(c.chain_id, c.num_blocks, c.block_size, max(1, c.stride),
                                    wire.unpack(c.block_state, wire.UINT8, name="block_state").tolist(),
                                    wire.unpack(c.ref_counts, wire.UINT8, name="ref_counts").tolist(),
                                    c.free_blocks, c.owned_blocks, c.shared_blocks, c.cached_blocks, seqs,
                                    c.running, c.waiting))
    return PoolSnapshot(chains, r.time)
