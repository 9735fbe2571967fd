"""Which node runs which role: the one placement used by --dry-run, Slurm and the tests.

A job is a list of nodes with the same number of GPUs each (0 on CPU clusters). With two or more
nodes every node gets exactly one role: the first ``T`` nodes train (the first of them hosts the
torchrun rendezvous), the rest run rollout servers. On one node both roles share the machine and
its GPUs are split between them. The plan is plain data; it is written to ``RUN_DIR/plan.json`` so
that every process of a job acts on the same placement instead of recomputing it.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from megatron_areal.cluster.config import ClusterConfig
from megatron_areal.server.config import ServerConfig


@dataclass(frozen=True)
class Node:
    name: str  # the Slurm node name (what --nodelist takes)
    addr: str  # the address other nodes reach it at


@dataclass(frozen=True)
class ServerSlot:
    id: str  # unique in the job: "<node>-<index on node>"
    node: str
    addr: str
    port: int
    gpus: tuple[int, ...]  # local GPU indices (CUDA_VISIBLE_DEVICES); empty on CPU

    @property
    def url(self) -> str:
        return f"http://{self.addr}:{self.port}"


@dataclass(frozen=True)
class TrainerLayout:
    nodes: tuple[str, ...]
    nproc_per_node: int
    gpus: tuple[int, ...]  # local GPU indices each trainer node uses; empty on CPU
    tp: int
    pp: int
    dp: int
    master_addr: str
    master_port: int

    @property
    def world_size(self) -> int:
        return len(self.nodes) * self.nproc_per_node


@dataclass
class Plan:
    nodes: tuple[Node, ...]
    gpus_per_node: int
    engine: str  # "embedded" or "sglang"
    server_tp: int
    port_stride: int
    servers: tuple[ServerSlot, ...]
    trainer: TrainerLayout
    errors: list[str] = field(default_factory=list)  # checks that fail: the job must not start
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # derived facts worth printing (memory estimate)

    @property
    def ok(self) -> bool:
        return not self.errors

    def role_of(self, node: str) -> str:
        """'trainer', 'rollout', 'both' (one-node jobs) or 'idle'."""
        trains = node in self.trainer.nodes
        serves = any(s.node == node for s in self.servers)
        return {(True, True): "both", (True, False): "trainer", (False, True): "rollout"}.get(
            (trains, serves), "idle")

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"node {name!r} is not in the plan (nodes: {', '.join(n.name for n in self.nodes)})")

    def servers_on(self, node: str) -> list[ServerSlot]:
        return [s for s in self.servers if s.node == node]

    def cpu_threads_on(self, node: str, server_threads: int, trainer_threads: int) -> int:
        """Torch threads the CPU roles on ``node`` ask for together (roles on GPUs count none)."""
        servers = sum(server_threads for s in self.servers_on(node) if not s.gpus)
        t = self.trainer
        return servers + (t.nproc_per_node * trainer_threads if node in t.nodes and not t.gpus else 0)

    def nodes_with_role(self, role: str) -> list[str]:
        return [n.name for n in self.nodes if self.role_of(n.name) in (role, "both")]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        return cls(
            nodes=tuple(Node(**n) for n in d["nodes"]), gpus_per_node=d["gpus_per_node"],
            engine=d["engine"], server_tp=d["server_tp"], port_stride=d["port_stride"],
            servers=tuple(ServerSlot(**{**s, "gpus": tuple(s["gpus"])}) for s in d["servers"]),
            trainer=TrainerLayout(**{**d["trainer"], "nodes": tuple(d["trainer"]["nodes"]),
                                     "gpus": tuple(d["trainer"]["gpus"])}),
            errors=list(d["errors"]), warnings=list(d["warnings"]), notes=list(d["notes"]))

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(self.to_json())
        tmp.replace(path)  # atomic: a reader on another node never sees half a plan

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(
                f"{path}: no launch plan. The run directory must be on a filesystem shared by all "
                f"nodes of the job (this node sees no {path.name} the batch step wrote).")
        return cls.from_dict(json.loads(path.read_text()))


def synthetic_nodes(count: int) -> list[Node]:
    """Node names for planning outside an allocation (``--dry-run --nodes N``)."""
    width = max(3, len(str(count)))
    return [Node(f"node{i + 1:0{width}d}", f"node{i + 1:0{width}d}") for i in range(count)]


def split_nodes(n_nodes: int, cluster: ClusterConfig) -> int:
    """Number of rollout nodes of a multi-node job (at least one of each role)."""
    gen = cluster.gen_nodes or round(n_nodes * cluster.gen_fraction)
    return min(max(gen, 1), n_nodes - 1)


def _place_servers(rollout: list[Node], gpus_per_node: int, gpu_offset: int, server: ServerConfig,
                   stride: int) -> list[ServerSlot]:
    slots: list[ServerSlot] = []
    if gpus_per_node > 0:  # every group of server.tp GPUs runs one server
        per_node = gpus_per_node // server.tp
        for node in rollout:
            for k in range(per_node):
                gpus = tuple(range(gpu_offset + k * server.tp, gpu_offset + (k + 1) * server.tp))
                slots.append(ServerSlot(f"{node.name}-{k}", node.name, node.addr,
                                        server.base_port + k * stride, gpus))
    else:  # CPU: server.count servers, round-robin over the rollout nodes
        for i in range(server.count):
            node, k = rollout[i % len(rollout)], i // len(rollout)
            slots.append(ServerSlot(f"{node.name}-{k}", node.name, node.addr,
                                    server.base_port + k * stride, ()))
    return slots


def _trainer_layout(trainers: list[Node], gpus: tuple[int, ...], tp: int, pp: int, cpu_dp: int,
                    master_port: int, errors: list[str]) -> TrainerLayout:
    model_parallel = tp * pp
    nproc = len(gpus) if gpus else model_parallel * cpu_dp
    world = nproc * len(trainers)
    if world % model_parallel:
        errors.append(f"trainer GPUs ({world}) are not divisible by parallel.tp * parallel.pp "
                      f"({tp} * {pp} = {model_parallel})")
    return TrainerLayout(nodes=tuple(n.name for n in trainers), nproc_per_node=nproc, gpus=gpus, tp=tp,
                         pp=pp, dp=max(world // model_parallel, 0), master_addr=trainers[0].addr,
                         master_port=master_port)


def make_plan(nodes: list[Node], gpus_per_node: int, cluster: ClusterConfig, server: ServerConfig,
              tp: int, pp: int) -> Plan:
    """Place servers and trainer ranks on ``nodes``; layout errors are collected, not raised."""
    if not nodes:
        raise ValueError("a plan needs at least one node")
    errors: list[str] = []
    engine = server.engine
    if gpus_per_node > 0 and server.tp > gpus_per_node:
        errors.append(f"server.tp ({server.tp}) exceeds the GPUs of one node ({gpus_per_node})")
    if gpus_per_node > 0 and gpus_per_node % server.tp:
        errors.append(f"GPUs per node ({gpus_per_node}) are not divisible by server.tp ({server.tp})")
    if len(nodes) == 1:
        gen_gpus, train_gpus = _split_one_node(gpus_per_node, cluster, server.tp, errors)
        servers = _place_servers(nodes, gen_gpus, 0, server, cluster.server_port_stride)
        trainer = _trainer_layout(nodes, tuple(range(gen_gpus, gen_gpus + train_gpus)), tp, pp,
                                  cluster.cpu_dp, cluster.master_port, errors)
    else:
        n_trainer = len(nodes) - split_nodes(len(nodes), cluster)
        trainers, rollout = nodes[:n_trainer], nodes[n_trainer:]
        servers = _place_servers(rollout, gpus_per_node, 0, server, cluster.server_port_stride)
        trainer = _trainer_layout(trainers, tuple(range(gpus_per_node)), tp, pp, cluster.cpu_dp,
                                  cluster.master_port, errors)
        if gpus_per_node > 0 and tp > gpus_per_node:
            errors.append(f"parallel.tp ({tp}) exceeds the GPUs of one node ({gpus_per_node}): "
                          "tensor parallelism across nodes is not supported")
    if not servers:
        errors.append("no rollout server fits the layout")
    return Plan(nodes=tuple(nodes), gpus_per_node=gpus_per_node, engine=engine, server_tp=server.tp,
                port_stride=cluster.server_port_stride, servers=tuple(servers), trainer=trainer,
                errors=errors)


def _split_one_node(gpus: int, cluster: ClusterConfig, server_tp: int, errors: list[str]) -> tuple[int, int]:
    """(generation GPUs, training GPUs) on a single node; (0, 0) on CPU."""
    if gpus == 0:
        return 0, 0
    if gpus < 2:
        errors.append(f"one node with {gpus} GPU cannot hold both a rollout server and the trainer; "
                      "use two GPUs or more")
        return 0, 0
    gen = round(gpus * cluster.gen_fraction) // server_tp * server_tp
    gen = min(max(gen, server_tp), gpus - 1)
    return gen, gpus - gen
