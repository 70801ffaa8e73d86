# A CPU model of the synchronisation in cuda/v3_fwd_sm90.cu (run_producer / run_consumer): the
# mbarrier phases of the Q buffers and K / V stages, the pingpong ring of named barriers, the
# fusion of a tile's last PV with the next tile's first S (into every tile, one-block ones too,
# with three Q buffers), the release of a Q buffer after the output store staged in it, with one Q
# buffer (two warpgroups) the output staged in the tile's last K / V stage (warpgroup 0 in its K
# tile, 1 in its V tile, each once the other is done reading it; the stage's release waits for the
# store, and comes before the next tile's Q wait where that tile's first block takes the stage),
# and clusters of two CTAs (load_kv, exchange_release, StagePhases). In a cluster both CTAs run
# tiles of the same bands, each with its own Q buffers, stages and barriers; each producer loads
# half of every K / V block both tiles visit into the stage of both CTAs (TMA multicast: the half
# completes transaction bytes on the "full" barrier of both, which expect the whole block), once
# its own consumers released the stage and it has told the other CTA's producer so (a remote
# arrival on its "peer" barrier) and heard the same from it. Under causal masking the two tiles of
# a band end at different key blocks: the CTA of the longer one loads the blocks only it visits
# whole into its own stage, and the other CTA passes those stage uses: its producer makes the
# exchange alone, its consumers skip them, and neither touches the stage's "full" or "empty"
# barriers, whose phases count blocks, not uses (StagePhases). One agent per role (a producer and W
# consumer warpgroups per CTA); per-warp arrivals are folded into one per warpgroup; a K / V load
# lands as an event of its own (one per half and CTA in a cluster, before or after the arrival that
# expects it), and so does a remote arrival; a Q load lands at once; a turn's GEMMs finish at a
# later step; stores finish reading when released. Random tile sequences (0 = empty tile: no Q, no
# turns) under random interleavings, alone and in clusters; reports deadlocks, a pingpong barrier
# given two arrivals before its sync, a stage / buffer read while it holds another block or tile
# (or half a block), a K / V part landing in a stage that its CTA's consumers have not all
# released or that an output store still reads, a warpgroup staging its output in a tile the other
# still reads, a remote arrival or a landing in a CTA that has exited, and a landing of a part whose
# issuing CTA has exited (the kernel has no cluster barrier before exit: each producer ends with
# one more exchange per stage, run_producer).
#
# Two or three K / V stages (Config::kStages: three at head dim 64).
#
#   python3 tests/gpu/v3_fwd_protocol_model.py [trials]     (prints "trials with errors: 0")
#
# Keep it in step with the kernel when the protocol changes. Mutations it catches: two staged Q
# buffers with fusion into one-block tiles (deadlock; checked at the end of every run) or dropping
# release_staged_output (deadlock), a wrong arrival count; in a cluster (checked at the end of
# every run, each by the error it must cause): no exchange, the peer arrival made in the own CTA,
# or waiting the peer barrier with parity phase ^ 1 (a half lands in the other CTA's stage while
# its consumers still read it: the wait passes on the word of the stage's previous use; mostly,
# though, that mutation deadlocks at the first K, where the later producer to wait sees phase 0
# complete already and waits for the other's next arrival, which needs its own missing half); a
# "full" barrier that expects only the own half (a consumer reads a stage with one half landed); no
# final exchange in the producer (a CTA exits with its half still on the way to the other); a
# passed use that completes the stage's "full" and "empty" phases (the first version of passing: a
# consumer that skipped it can find its wait for the stage's next block "done" before the producer
# passed the use, and reads the stage before that block lands); a passed use that waits for the own
# stage's last block to be released (deadlock: that block can be the pending tile's last V,
# released only once the next tile's first block, behind the passed use, is in); a block only one
# tile visits loaded as a shared half (a consumer reads a stage with one of two parts); with the
# output staged in K / V: no staging tile barrier (a warpgroup stages into a tile the other still
# reads), the stage released before the store read it (a block lands under the store), no release
# before the Q wait (deadlock: the producer loads the Q behind that stage's block).
import random
import sys

class MBar:
    """A phase completes once `count` arrivals were made and every part the arrivals expect
    (arrive_expect_tx; a part: a K / V half in a cluster, a whole block alone) has landed. A part
    may land before the arrival that expects it (the other CTA's half): the pending arrival keeps
    the phase open."""
    def __init__(s, count): s.count, s.arrived, s.parts_due, s.done = count, 0, 0, 0
    def arrive(s, expect_parts=0):
        s.parts_due += expect_parts
        s.arrived += 1
        s.complete_if_due()
    def land_part(s):
        s.parts_due -= 1
        s.complete_if_due()
    def complete_if_due(s):
        if s.arrived == s.count and s.parts_due == 0: s.arrived, s.done = 0, s.done + 1
    def ready(s, parity): return (s.done % 2) != parity

class Stage:
    """What a K or V stage of one CTA holds: a key block, how many of its parts have landed (one
    per producer of the cluster), and how many consumer warpgroups are done with it."""
    def __init__(s, W): s.block, s.parts, s.released = None, 0, W  # free: nothing to read

class Cta:
    """One CTA's barriers and buffers; `running` counts its agents that have not finished."""
    def __init__(s, rank, W, nbuf, stages):
        s.rank = rank
        s.q_full = [MBar(1) for _ in range(nbuf)]
        s.q_empty = [MBar(W) for _ in range(nbuf)]
        s.qbuf_content = [None] * nbuf
        s.store_reading = [0] * nbuf  # unreleased stores reading each Q buffer
        s.full = {kv: [MBar(1) for _ in range(stages)] for kv in "KV"}
        s.empty = {kv: [MBar(W) for _ in range(stages)] for kv in "KV"}
        s.peer = {kv: [MBar(1) for _ in range(stages)] for kv in "KV"}  # used in a cluster
        s.stage = {kv: [Stage(W) for _ in range(stages)] for kv in "KV"}
        s.stage_store = {kv: [0] * stages for kv in "KV"}  # unreleased output stores reading
        s.tile_done = {kv: 0 for kv in "KV"}  # staging_tile_barrier arrivals not yet synced
        s.ring = [0] * W  # pending arrivals per pingpong barrier
        s.running = W + 1

# Cluster mutations of the producer, each with (a part of) the error it must cause.
CLUSTER_MUTATIONS = {
    "no release exchange": "lands while",
    "peer arrival in the own CTA": "lands while",
    "peer wait parity phase ^ 1": "lands while",
    "full barrier expects the own half only": "of 2 parts",
    "no final exchange": "after its issuer's exit",
    "a passed use completes the stage's phases": "holds block",
    "a passed use waits for the own stage": "DEADLOCK",
    "lone block loaded as a shared half": "of 2 parts",
}
# Mutations of the one-Q-buffer output staging in the last K / V stage (stage_output_in_kv), alone
# or in a cluster, each with the error it must cause.
KV_STAGING_MUTATIONS = {
    "no staging tile barrier": "stages its output in",
    "staged stage released before its store read it": "under an output store",
    "no release before the Q wait": "DEADLOCK",
}

def run(tiles, W, staged, seed, staged_buffers=3, cluster=1, mutation=None, stages=2):
    """tiles: per tile, the key blocks of each CTA's tile (a tuple of `cluster` counts, all 0 or
    none: the pair runs both or neither)."""
    rnd = random.Random(seed)
    nbuf = staged_buffers if staged else 1
    ctas = [Cta(rank, W, nbuf, stages) for rank in range(cluster)]
    in_flight = []  # K / V parts and remote arrivals on the way (events of their own)
    errors = []

    def land(cta, kv, st, block, issuer):
        if not cta.running: errors.append(f"CTA{cta.rank}: {kv}{block} lands after its exit")
        if not issuer.running:
            errors.append(f"CTA{cta.rank}: {kv}{block} lands after its issuer's exit")
        stage = cta.stage[kv][st]
        if cta.stage_store[kv][st]:
            errors.append(f"CTA{cta.rank}: {kv}{block} lands under an output store")
        if stage.block != block:
            if stage.released < W:
                errors.append(f"CTA{cta.rank} {kv} stage {st}: block {block} lands while block "
                              f"{stage.block} is in use")
            stage.block, stage.parts, stage.released = block, 0, 0
        stage.parts += 1
        cta.full[kv][st].land_part()

    def arrive_on_peer(cta, kv, st):
        if not cta.running: errors.append(f"CTA{cta.rank}: peer arrival after its exit")
        cta.peer[kv][st].arrive()

    def exchange_release(cta, kv, st, ph):
        if mutation == "no release exchange": return
        peer = cta if mutation == "peer arrival in the own CTA" else ctas[cta.rank ^ 1]
        in_flight.append(lambda: arrive_on_peer(peer, kv, st))
        # One arrival each way per stage use: the use's own phase, not ph ^ 1 as for "empty".
        parity = ph ^ 1 if mutation == "peer wait parity phase ^ 1" else ph
        yield lambda: cta.peer[kv][st].ready(parity)

    # "full" / "empty" phases count the blocks a stage took (StagePhases), the exchange its uses;
    # the mutation counts uses for both, as the first version did.
    by_use = mutation == "a passed use completes the stage's phases"

    def acquire_stage(cta, kv, st, fill_ph, use_ph):
        yield lambda: cta.empty[kv][st].ready(fill_ph ^ 1)
        if cluster > 1: yield from exchange_release(cta, kv, st, use_ph)

    def load_kv(cta, kv, st, fill_ph, use_ph, block, alone):
        yield from acquire_stage(cta, kv, st, fill_ph, use_ph)
        own_half_only = mutation == "full barrier expects the own half only"
        cta.full[kv][st].arrive(expect_parts=1 if own_half_only else cluster)
        if alone and mutation != "lone block loaded as a shared half":
            for _ in range(cluster):  # every part of the block, into this CTA only
                in_flight.append(lambda: land(cta, kv, st, block, cta))
            return
        for dst in ctas:  # the multicast: this producer's part lands in every CTA
            in_flight.append(lambda dst=dst: land(dst, kv, st, block, cta))

    def pass_stage(cta, kv, st, fill_ph, use_ph):
        if by_use:
            yield from acquire_stage(cta, kv, st, fill_ph, use_ph)
            cta.full[kv][st].arrive()
            for _ in range(W): cta.empty[kv][st].arrive()
        elif mutation == "a passed use waits for the own stage":
            yield from acquire_stage(cta, kv, st, fill_ph, use_ph)
        else:  # no wait for the own stage: it may hold the pending tile's V
            yield from exchange_release(cta, kv, st, use_ph)

    def stage_use(cta, kv, st, fill_ph, use_ph, block, own, nb, peer):
        """Key block nb of the pair's tiles (own / peer: how many blocks this CTA's and the other
        CTA's tile visit): passed where only the other tile visits it, loaded alone where only
        this one does, shared otherwise."""
        if nb >= own: yield from pass_stage(cta, kv, st, fill_ph, use_ph)
        else: yield from load_kv(cta, kv, st, fill_ph, use_ph, block, alone=nb >= peer)

    def producer(cta):
        bc = qc = 0
        blocks = [0] * stages  # blocks each stage took
        for ti, counts in enumerate(tiles):
            nblocks, peer = counts[cta.rank], counts[cta.rank ^ (cluster - 1)]
            if nblocks == 0: continue
            qb, qph = qc % nbuf, (qc // nbuf) & 1
            qc += 1
            def load_q():
                yield lambda: cta.q_empty[qb].ready(qph ^ 1)
                if cta.store_reading[qb]:
                    errors.append(f"CTA{cta.rank}: Q{ti} overwrites buffer {qb} under a store")
                cta.qbuf_content[qb] = ti; cta.q_full[qb].arrive()
            if staged: yield from load_q()
            for nb in reversed(range(max(nblocks, peer))):
                st, use_ph = bc % stages, (bc // stages) & 1
                fill_ph = use_ph if by_use else blocks[st] & 1
                yield from stage_use(cta, "K", st, fill_ph, use_ph, bc, nblocks, nb, peer)
                if not staged and nb == nblocks - 1: yield from load_q()
                yield from stage_use(cta, "V", st, fill_ph, use_ph, bc, nblocks, nb, peer)
                if nb < nblocks: blocks[st] += 1
                bc += 1
        # In a cluster, every stage free in both CTAs before the exit: all halves have landed.
        if cluster > 1 and mutation != "no final exchange":
            for _ in range(stages):
                st, use_ph = bc % stages, (bc // stages) & 1
                fill_ph = use_ph if by_use else blocks[st] & 1
                yield from acquire_stage(cta, "K", st, fill_ph, use_ph)
                yield from acquire_stage(cta, "V", st, fill_ph, use_ph)
                bc += 1

    def consumer(cta, w):
        ring = cta.ring
        if w == W - 1: ring[0] += 1
        c = dict(bc=0, qc=0, unreleased=-1)
        blocks = [0] * stages  # blocks each stage took, as far as this warpgroup waited
        phase_of = {}  # slot -> the "full" phase parity its block was waited with
        pending = [None]
        def turn():
            yield lambda: ring[w] > 0
            ring[w] -= 1
            nxt = (w + 1) % W
            ring[nxt] += 1
            if ring[nxt] > 1: errors.append(f"CTA{cta.rank} barrier {nxt} got two arrivals")
        def release_staged():
            buf = c['unreleased']
            if buf >= 0 and staged:
                cta.store_reading[buf] -= 1; cta.q_empty[buf].arrive()
            elif buf >= 0:  # this warpgroup's K or V tile
                kv = "KV"[w]
                cta.stage_store[kv][buf] -= 1
                if mutation != "staged stage released before its store read it":
                    release(kv, buf)  # the stage's index stands for its block
            c['unreleased'] = -1
        def write_output(buf):
            if staged:
                cta.store_reading[buf] += 1; c['unreleased'] = buf
        def stage_output_in_kv(block):
            """One Q buffer: warpgroup 0 stages its output in the tile's last K tile, 1 in its V
            tile, once the other one is done reading it (staging_tile_barrier); the store holds
            the stage until release_staged."""
            kv, st = "KV"[w], block % stages
            if mutation != "no staging tile barrier":
                yield lambda: cta.tile_done[kv] > 0
                cta.tile_done[kv] -= 1
            stage = cta.stage[kv][st]
            if stage.block != block or stage.released != W - 1:
                errors.append(f"CTA{cta.rank} wg{w} stages its output in {kv} stage {st} "
                              f"holding block {stage.block} ({stage.released} of {W} done)")
            if mutation == "staged stage released before its store read it":
                release(kv, block)
            cta.stage_store[kv][st] += 1
            c['unreleased'] = st
        def take(kv, block):
            st = block % stages
            if kv == "K":  # the block's phase, for its V too
                phase_of[block] = (block // stages) & 1 if by_use else blocks[st] & 1
                blocks[st] += 1
            yield lambda: cta.full[kv][st].ready(phase_of[block])
            stage = cta.stage[kv][st]
            if stage.block != block or stage.parts != cluster:
                errors.append(f"CTA{cta.rank} wg{w} {kv} stage {st} holds block {stage.block} "
                              f"({stage.parts} of {cluster} parts), wants {block}")
        def release(kv, block):
            cta.stage[kv][block % stages].released += 1
            cta.empty[kv][block % stages].arrive()
        def last_pv_alone():
            last = c['bc'] - 1
            yield from take("V", last)
            yield from turn()
            yield lambda: True  # the PV GEMM runs (wgmma_wait)
            if staged or w == 0: release("V", last)
            if staged:
                write_output(pending[0])
            else:
                if w == 0: cta.tile_done["V"] += 1  # warpgroup 1 may stage in this V tile
                yield from stage_output_in_kv(last)
            pending[0] = None
        for ti, counts in enumerate(tiles):
            nblocks = counts[cta.rank]
            if nblocks == 0: continue
            fuse = staged and pending[0] is not None
            qb = c['qc'] % nbuf
            passed = max(counts) - nblocks
            # After an odd count of passed uses the first block takes the staged output's stage,
            # which the producer loads, and the Q behind it, only once the store read it.
            if (not staged and c['unreleased'] == (c['bc'] + passed) % stages
                    and mutation != "no release before the Q wait"):
                release_staged()
            yield lambda: cta.q_full[qb].ready((c['qc'] // nbuf) & 1)
            if cta.qbuf_content[qb] != ti:
                errors.append(f"CTA{cta.rank} wg{w} Q buffer {qb} holds {cta.qbuf_content[qb]}, "
                              f"wants {ti}")
            c['qc'] += 1
            pending_block = c['bc'] - 1  # the pending tile's last block (fuse)
            c['bc'] += passed  # the uses the producer passed
            for j in range(nblocks):
                bc = c['bc']
                prev = bc - 1 if j > 0 else pending_block
                yield from take("K", bc)
                with_pv = j > 0 or fuse
                if with_pv: yield from take("V", prev)
                yield from turn()
                if staged or j == 0: release_staged()
                yield lambda: True  # the GEMMs run (wgmma_wait)
                if cta.qbuf_content[qb] != ti:
                    errors.append(f"CTA{cta.rank} wg{w} S reads Q buffer {qb} holding "
                                  f"{cta.qbuf_content[qb]}")
                last = j == nblocks - 1
                if staged or not last or w == 1: release("K", bc)
                if not staged and last:
                    cta.q_empty[0].arrive()
                    if w == 1: cta.tile_done["K"] += 1  # warpgroup 0 may stage in this K tile
                if with_pv: release("V", prev)
                if j == 0 and fuse: write_output(pending[0])
                c['bc'] += 1
            pending[0] = qb
            if not staged: yield from last_pv_alone()
        if pending[0] is not None: yield from last_pv_alone()
        if not staged: release_staged()

    agents = [(cta, producer(cta)) for cta in ctas]
    agents += [(cta, consumer(cta, w)) for cta in ctas for w in range(W)]
    conds = [None] * len(agents)
    alive = list(range(len(agents)))
    while alive or in_flight:
        runnable = [i for i in alive if conds[i] is None or conds[i]()]
        if not runnable and not in_flight:
            return errors + ["DEADLOCK"]
        pick = rnd.randrange(len(runnable) + len(in_flight))
        if pick >= len(runnable):
            in_flight.pop(pick - len(runnable))()
            continue
        i = runnable[pick]
        cta, agent = agents[i]
        try:
            conds[i] = next(agent)
        except StopIteration:
            alive.remove(i)
            cta.running -= 1
    return errors

def random_case(trial, cluster):
    """Tiles of random lengths; in a cluster the pair's tiles end 0-2 key blocks apart, as
    causal masking ends a band's two m-blocks (about half the trials), or together."""
    r = random.Random(trial)
    causal = r.random() < 0.5
    tiles = []
    for _ in range(r.randint(1, 9)):
        n = r.choice([0, 1, 1, 2, 3, 5])
        counts = [n] + [max(1, n + r.choice([-2, -1, 0, 1, 2])) if n and causal else n
                        for _ in range(cluster - 1)]
        tiles.append(tuple(counts))
    W, staged = r.choice([2, 3]), r.choice([True, False])
    return tiles, W if staged else 2, staged, r.choice([2, 3])  # one Q buffer: two warpgroups

def first_symptom(mutation, symptom, trials=1000, staged_only=None):
    """The first (trial, error) of random cluster trials under `mutation` that shows `symptom`
    (staged_only: only the trials with (True) or without (False) staged Q buffers)."""
    for trial in range(trials):
        tiles, W, staged, stages = random_case(trial, 2)
        if staged_only is not None and staged != staged_only: continue
        for error in run(tiles, W, staged, trial, cluster=2, mutation=mutation, stages=stages):
            if symptom in error: return trial, error
    return None

bad = 0
for trial in range(int(sys.argv[1]) if len(sys.argv) > 1 else 20000):
    cluster = 1 + trial % 2  # half the trials alone, half in clusters of two
    tiles, W, staged, stages = random_case(trial, cluster)
    errs = run(tiles, W, staged, trial, cluster=cluster, stages=stages)
    if errs:
        bad += 1
        if bad < 5: print(trial, tiles, W, staged, cluster, stages, errs[:3])
print("trials with errors:", bad)
# The reason for the third buffer: with two, a one-block tile that takes the previous tile's PV
# leaves its store unreleased until the next tile's first issue, which waits for a Q that the
# producer can only load into that buffer.
two_buffers_deadlock = "DEADLOCK" in run([(2,), (1,), (2,)], 2, True, 0, staged_buffers=2)
print("two staged buffers, fused one-block tile:", "deadlock (as expected)" if two_buffers_deadlock
      else "NO DEADLOCK: the model no longer shows why three buffers are needed")
# The cluster protocol's parts, each shown necessary by the error its mutation causes.
mutations_missed = 0
for mutation, symptom in list(CLUSTER_MUTATIONS.items()) + list(KV_STAGING_MUTATIONS.items()):
    found = first_symptom(mutation, symptom,
                          staged_only=False if mutation in KV_STAGING_MUTATIONS else None)
    if found is None: mutations_missed += 1
    print(f"cluster, {mutation}:", f"trial {found[0]}: {found[1]}" if found
          else f"NOT CAUGHT: no \"{symptom}\" error")
sys.exit(1 if bad or not two_buffers_deadlock or mutations_missed else 0)
