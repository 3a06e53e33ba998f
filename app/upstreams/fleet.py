"""The upstreams behind one gate: one per configured URL, or per address of a name that
resolves to several (a Kubernetes headless Service, a DNS round-robin name), kept current."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
import socket
from collections.abc import Awaitable, Callable, Iterator
from urllib.parse import parse_qs, urlsplit

from slotgate.asgi import Header
from slotgate.gate.admission import Admission
from slotgate.gate.models import Lane, Models
from slotgate.gate.pool import Pool
from slotgate.settings import Settings
from slotgate.upstreams.router import Router, served_names
from slotgate.upstreams.server import address_url
from slotgate.upstreams.upstream import Upstream

log = logging.getLogger("slotgate.fleet")

#: Resolves a host name to its addresses (the system resolver unless a test gives another).
Resolver = Callable[[str, int], Awaitable[list[str]]]

#: A Prometheus sample line: its name, its labels if any (a quoted value may hold "}" or an
#: escaped quote), the rest.
_SAMPLE = re.compile(
    rb'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[^"}\n]|"(?:[^"\\\n]|\\.)*")*\})?( [^\n]*)$'
)


async def system_resolver(host: str, port: int) -> list[str]:
    """The addresses of `host` in the system resolver's first family, in its order.

    One family only: a name with an IPv4 and an IPv6 address (`localhost`) is one server,
    reached by either, not two.
    """
    infos = await asyncio.get_running_loop().getaddrinfo(
        host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
    )
    if not infos:
        return []
    family = infos[0][0]
    addresses: list[str] = []
    for info in infos:
        address = str(info[4][0])
        if info[0] == family and address not in addresses:
            addresses.append(address)
    return addresses


class _Source:
    """One configured URL and the upstreams it stands for now."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.url = url
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        #: A name (not an address) may stand for several servers: it is resolved again at
        #: every refresh.
        self.named = not _is_address(self.host)
        #: By address; the name itself (key None) while it resolves to one address or fewer.
        self.upstreams: dict[str | None, Upstream] = {}
        #: The address the name last resolved to alone (where the name's upstream runs).
        self.single: str | None = None


class Fleet:
    """Every upstream, its pool in the admission core, and the discovery that keeps the set
    current; slotgate is ready while any upstream is."""

    def __init__(
        self,
        settings: Settings,
        admission: Admission,
        resolver: Resolver | None = None,
        models: Models | None = None,
    ) -> None:
        self._settings = settings
        self._admission = admission
        self._resolve = resolver or system_resolver
        self._sources = [_Source(url) for url in settings.llama_server_urls]
        self._by_pool: dict[Pool, Upstream] = {}
        #: More than one upstream: requests are routed, so they carry an affinity key. (An
        #: attribute, kept as `_by_pool` changes: every request reads it.)
        self.several = False
        #: The lines of the models routers serve (app/gate/models.py); their pools' upstreams.
        self.lanes = models
        self._model_pools: dict[Pool, Upstream] = {}
        self._placing: asyncio.Task[None] | None = None
        self._discovery: asyncio.Task[None] | None = None
        self._started = False
        #: Upstreams whose address left, each until its last request has ended.
        self._leaving: dict[asyncio.Task[None], Upstream] = {}
        self._warned_models: set[str] = set()
        self._all: list[Upstream] = []
        #: Every upstream is known to add no `__verbose` unasked before any answer shows it,
        #: and through its restarts (a test's word; slotgate itself learns it per upstream).
        self.known_quiet = False
        for source in self._sources:
            self._add(source, None)

    # -- reading --------------------------------------------------------------------------------

    @property
    def upstreams(self) -> list[Upstream]:
        """Every upstream taking work, in the order configured (and discovered)."""
        return self._all

    @property
    def ready(self) -> bool:
        # Not those leaving: they answer, but admit nothing more.
        return any(upstream.ready for upstream in self._all)

    @property
    def reason(self) -> str:
        """Why no upstream is ready: the only one's reason, or each one's."""
        upstreams = self.upstreams
        if len(upstreams) == 1:
            return upstreams[0].reason
        return "; ".join(f"{u.url}: {u.reason}" for u in upstreams)

    @property
    def unreached(self) -> str | None:
        """Why no upstream can be reached, when none has answered anything since slotgate
        started (see Upstream.unreached); None while any might be loading or restarting."""
        upstreams = self.upstreams
        if not upstreams or any(u.unreached is None for u in upstreams):
            return None
        return "; ".join(u.unreached for u in upstreams if u.unreached is not None)

    @property
    def primary(self) -> Upstream:
        """The upstream for what is not routed by slots (counts, ungated requests): the first
        ready one, else the first."""
        upstreams = self._all
        for upstream in upstreams:
            if upstream.ready:
                return upstream
        return upstreams[0]

    def serving(self, query: bytes) -> Upstream:
        """The upstream for a request that takes no slot: with lines per model, one that
        serves its `?model=` (a router's `/props?model=`, `/metrics?model=`), else `primary`."""
        lanes = self.lanes
        if lanes is None or not lanes.routed or b"model=" not in query:
            return self.primary
        names = parse_qs(query.decode("latin-1")).get("model")
        lane = lanes.find(names[-1]) if names else None
        return self.primary if lane is None else self.of_lane(lane)

    def of_lane(self, lane: Lane) -> Upstream:
        """An upstream that serves `lane`'s model: one with its slots known, if any."""
        for pool in sorted(lane.admission.pools, key=lambda p: p.capacity is None):
            if (upstream := self._model_pools.get(pool)) is not None:
                return upstream
        return self.primary

    @property
    def quiet(self) -> bool:
        """Every upstream has shown that it adds no `__verbose` unasked (no --verbose): a
        request is routed only once admitted, so it is assembled only when wherever it may
        go is known not to."""
        return self.known_quiet or all(upstream.verbose is False for upstream in self._all)

    def of(self, pool: Pool) -> Upstream:
        try:
            return self._by_pool[pool]
        except KeyError:  # a model's pool (app/upstreams/router.py, `_place`)
            return self._model_pools[pool]

    def _routing(self, upstream: Upstream) -> Router:
        """`upstream` is a llama-server in router mode: its models' pools join their lanes."""
        models = self.lanes
        assert models is not None  # noqa: S101 - given to upstreams only with models
        models.routed = True
        if upstream.model_pool is not None:
            # A server of one model before: its model is not served here any more.
            models.unplace(upstream.model_pool, upstream.url)
        if any(u.router is None for u in self._all):
            self._place_all()  # servers of one model beside the router join their lines

        def adopt(pool: Pool) -> None:
            self._model_pools[pool] = upstream

        settings = self._settings
        return Router(
            upstream, models, adopt, settings.model_swap_after_s, settings.props_refresh_interval_s
        )

    def models(self) -> set[str]:
        """The models the ready upstreams serve (one, as meant, unless they disagree)."""
        return {
            u.props.model for u in self._by_pool.values() if u.ready and u.props and u.props.model
        }

    def _check_models(self) -> None:
        models = self.models()
        lanes = self.lanes
        if len(models) > 1 and models != self._warned_models:
            log.warning(
                "the upstreams serve different models (%s): %s",
                ", ".join(sorted(models)),
                "requests are routed by their model"
                if lanes is not None
                else "slotgate routes by slots and cache, not by model",
            )
        self._warned_models = models
        if lanes is None:
            return
        if len(self._all) == 1 and self._all[0].router is None:
            # One upstream, a router no more (restarted with -m): it serves whatever a request
            # names, as before any router was seen. (In a fleet the lines stay: a server of
            # one model that is down must not let its requests go to another's.)
            lanes.routed = False
        elif lanes.routed or len(models) > 1:
            self._place_all()

    def _place_all(self) -> None:
        """Each ready server of one model joins its model's line (once), in a task of its own:
        its names come from its `/v1/models`."""
        if self._placing is None or self._placing.done():
            self._placing = asyncio.create_task(self._place(), name="slotgate-models")

    async def _place(self) -> None:
        lanes = self.lanes
        assert lanes is not None  # noqa: S101 - placed only with lanes
        for upstream in list(self._all):
            if upstream.router is not None or not upstream.ready:
                continue
            # Read again at each of its returns: it may have come back serving another model.
            names = await served_names(upstream)
            lane = lanes.lane(names[0], names[1:], upstream.url) if names else None
            placed = upstream.model_pool
            if lane is None or (placed is not None and placed in lane.admission.pools):
                continue
            if placed is not None:
                # Restarted with another model: none of its old model's requests go to it.
                lanes.unplace(placed, upstream.url)
                log.info("upstream leaves the line of its old model url=%s", upstream.url)
            pool = lane.admission.add_pool(upstream.url)
            self._model_pools[pool] = upstream
            upstream.model_pool = pool
            if upstream.draining:
                pool.drain()  # an operator drained it before it joined its model's line
            upstream.placed_model = None if upstream.props is None else upstream.props.model
            lane.states[upstream.url] = "loaded"
            pool.resize_budget(upstream.pool.budget)
            pool.resize(upstream.pool.capacity)
            log.info("upstream joins the line of model %s url=%s", lane.model, upstream.url)
        # From now on a request waits in its model's line (servers placed before it is read).
        lanes.routed = True

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        self._started = True
        for upstream in self.upstreams:
            await upstream.start()
        if any(source.named for source in self._sources):
            await self.discover()
            self._discovery = asyncio.create_task(self._rediscover(), name="slotgate-discovery")

    async def close(self) -> None:
        tasks = [t for t in (self._discovery, self._placing, *self._leaving) if t is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            # Not `await task` under suppress(CancelledError): that would swallow a
            # cancellation of the caller's own task too.
            await asyncio.wait(tasks)
            for task in tasks:
                if not task.cancelled() and (error := task.exception()) is not None:
                    raise error
        for upstream in list(self._by_pool.values()):
            await upstream.close()

    def poke(self) -> None:
        """Read every upstream's /props now (a request waits for any of them)."""
        for upstream in self._by_pool.values():
            upstream.poke()

    async def metrics(self) -> tuple[bytes, list[Header]]:
        """llama-server's own /metrics: as it is from one upstream; from several, each sample
        labelled with its upstream, and each family's HELP and TYPE once."""
        upstreams = self.upstreams
        if len(upstreams) == 1 and upstreams[0].router is None:
            return await upstreams[0].metrics()
        sources: list[tuple[bytes, Awaitable[tuple[bytes, list[Header]]]]] = []
        for upstream in upstreams:
            label = b'upstream="' + _escape(upstream.url) + b'"'
            router = upstream.router
            if router is None:
                sources.append((label, upstream.metrics()))
                continue
            # A router's own /metrics is a 400: each running child's, labelled with its model.
            for model, path in router.metrics_targets():
                labels = label + b',model="' + _escape(model) + b'"'
                sources.append((labels, upstream.metrics(path)))
        answers = await asyncio.gather(*(answer for _, answer in sources))
        # The text format wants each family as one group: its HELP and TYPE once (the first
        # upstream's, should builds word them differently), then every upstream's samples.
        families: dict[bytes, tuple[dict[bytes, bytes], list[bytes]]] = {}
        for (label, _), (text, _) in zip(sources, answers, strict=True):
            family: bytes | None = None
            for line in text.splitlines():
                if line.startswith(b"#"):
                    words = line.split(None, 3)
                    if len(words) > 2 and words[1] in (b"HELP", b"TYPE"):
                        family = words[2]
                        families.setdefault(family, ({}, []))[0].setdefault(words[1], line)
                    continue
                match = _SAMPLE.match(line)
                if match is None:
                    continue
                if family is None or not match[1].startswith(family):
                    family = match[1]  # a sample with no HELP or TYPE of its own
                families.setdefault(family, ({}, []))[1].append(_labelled(match, label))
        lines = [
            line
            for comments, samples in families.values()
            for line in (*comments.values(), *samples)
        ]
        return (b"\n".join(lines) + b"\n" if lines else b""), []

    # -- discovery ------------------------------------------------------------------------------

    async def discover(self) -> None:
        """Resolve every named URL again: a new address joins, a vanished one stops receiving
        work and leaves once its requests end."""
        for source in self._sources:
            if not source.named:
                continue
            try:
                addresses = await self._resolve(source.host, source.port)
            except (OSError, ValueError) as exc:
                # The name's servers are what they were: a resolver that fails says nothing of
                # them, and their own /props followers tell whether they answer. A name that
                # cannot be encoded (an empty or long label) is a UnicodeError, a ValueError.
                log.warning("cannot resolve %s: %s", source.host, exc)
                continue
            by_address = len(addresses) > 1
            wanted: set[str | None] = set(addresses) if by_address else {None}
            if len(addresses) == 1 and addresses[0] in source.upstreams:
                # A fleet scaled down to one server: the upstream that runs its requests is
                # known by the name again (as a replica started now knows it, so that Redis
                # counts its slots once), its running requests counted on it.
                upstream = source.upstreams.pop(addresses[0])
                upstream.readdress(None)
                source.upstreams[None] = upstream
                self._list()
            single = source.single
            if single is not None and by_address and None in source.upstreams and single in wanted:
                # The name's one server is one of several now: the upstream that runs its
                # requests becomes that address's, so they stay counted against its slots.
                upstream = source.upstreams.pop(None)
                upstream.readdress(single)
                source.upstreams[single] = upstream
                self._list()
            if len(addresses) == 1:
                source.single = addresses[0]
            for key in wanted - source.upstreams.keys():
                log.info("upstream joins: %s", key or source.url)
                if self._revive(source, key) is not None:
                    continue
                upstream = self._add(source, key)
                if self._started:
                    await upstream.start()
            for key in source.upstreams.keys() - wanted:
                self._retire(source, key)

    async def _rediscover(self) -> None:
        while True:
            await asyncio.sleep(self._settings.props_refresh_interval_s)
            await self.discover()

    def _add(self, source: _Source, address: str | None) -> Upstream:
        url = source.url
        pool = self._admission.add_pool(_pool_key(source, address))
        routing = self._routing if self.lanes is not None else None
        upstream = Upstream(self._settings, pool, url, address, self._check_models, routing)
        source.upstreams[address] = upstream
        self._by_pool[pool] = upstream
        self.several = len(self._by_pool) > 1
        self._list()
        return upstream

    def _retire(self, source: _Source, key: str | None) -> None:
        upstream = source.upstreams.pop(key)
        self._list()
        log.info("upstream leaves: %s", upstream.url)
        upstream.pool.retire()
        if upstream.model_pool is not None:
            upstream.model_pool.retire()
        task = asyncio.create_task(self._leave(upstream), name="slotgate-upstream-leaves")
        self._leaving[task] = upstream
        task.add_done_callback(self._left)

    def _left(self, task: asyncio.Task[None]) -> None:
        self._leaving.pop(task, None)

    def _revive(self, source: _Source, address: str | None) -> Upstream | None:
        """The same server back while its last requests still run there: it takes work again
        as itself, its holders counted against its slots (a second pool for it would not)."""
        key = _pool_key(source, address)
        for task, upstream in self._leaving.items():
            if upstream.pool.key == key and upstream.pool.active:
                task.cancel()
                upstream.pool.revive()
                if upstream.model_pool is not None:
                    upstream.model_pool.revive()
                source.upstreams[address] = upstream
                self._list()
                upstream.poke()  # its slot count now, not at the next tick
                return upstream
        return None

    async def _leave(self, upstream: Upstream) -> None:
        """Close a retired upstream once its last request has ended."""
        # A retired pool's last release sets no event of its own; a look per refresh is enough.
        while upstream.pool.active:  # noqa: ASYNC110
            await asyncio.sleep(self._settings.props_refresh_interval_s)
        self._by_pool.pop(upstream.pool, None)
        self.several = len(self._by_pool) > 1
        await upstream.close()

    def _list(self) -> None:
        self._all = [u for source in self._sources for u in source.upstreams.values()]

    def __iter__(self) -> Iterator[Upstream]:
        return iter(self.upstreams)


def _pool_key(source: _Source, address: str | None) -> str:
    return source.url if address is None else address_url(urlsplit(source.url), address)


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _escape(text: str) -> bytes:
    """A label value as the text format writes it (a router's model id is a file name: it
    may hold any of the three)."""
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").encode()


def _labelled(match: re.Match[bytes], label: bytes) -> bytes:
    name, labels, rest = match.groups()
    if labels is None or labels == b"{}":
        return name + b"{" + label + b"}" + rest
    # The text format allows a trailing comma after the last label.
    comma = b"" if labels.endswith(b",}") else b","
    return name + labels[:-1] + comma + label + b"}" + rest
