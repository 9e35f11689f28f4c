/*
 * The lease protocol (docs/PROTOCOL.md) as a model for spin.
 *
 * docs/PROTOCOL.md section 7 says which code each process stands for, how big
 * each check is, and how to run it; tests/spec/test_spin_model.py runs them.
 *
 * One P engine id, served first by process (instance) 1 and, after a crash, by
 * instance 2: ours, or stock vLLM (a downgrade).  Each P process has NRANK TP
 * ranks (one lease table and one NIXL agent each).  One D (scheduler and one
 * worker) holds request r0, granted by instance 1, and with NREQ 2 also r1,
 * granted by whichever process runs then.  Y is another D's lease whose key
 * (tag or id) collides with r0's, granted at most once by whichever of our
 * processes runs.
 *
 * Time is discrete and unbounded; every timer is kept relative to now (what
 * is left, or how old), so the state space is finite without a time bound.
 * D's clock is the reference.  P's clock is D's plus POFF(instance) plus a
 * skew in 0..DRIFT that changes by at most 1 per tick, so P's clock advances
 * 0, 1 or 2 per tick and never runs backwards (A1-A2).  D converts P's
 * deadlines with the offset it measured at its handshake (POFF and the skew
 * then).
 *
 * Faults (all off with -DNOFAULT, the schedule of the liveness claim): the
 * network loses, duplicates, reorders and delays messages (a bag), a link
 * cuts and heals, P crashes and restarts under the same engine id, P forgets
 * an agent, D releases its connection (an invalid engine, a repeated
 * handshake), any process stalls (time passes while it takes no step).
 * Without faults, time passes only when no process can move (timeout).
 *
 * Mutations, one at a time, each must yield a counterexample:
 *   MUT_RENEW_ON_SEND     D renews acknowledged views when it sends a heartbeat
 *   MUT_NO_EPOCH          D keys proof and views by engine id, not instance
 *   MUT_REMEMBERED_CAPS   what an engine id proved is remembered across its
 *                         connections (the old `acked_engines`)
 *   MUT_NO_TOMBSTONES     P answers "held" for any live lease a colliding key
 *                         names (no tombstones, no ambiguity)
 *   MUT_NO_COMPLETION_MARGIN  D keeps a completed READ seen before its view's
 *                         or its posted deadline, with no margin (the old discard_late)
 *   MUT_COMP_ANY_CONN     D sends an abort's completion over any connection
 *   MUT_DROP_PARKED       an aborted parked READ is dropped, never reported
 *   MUT_TWO_READS         two local requests of one lease both read it
 *   MUT_FREE_ON_FIRST_COMPLETION  P frees on a completion while another agent
 *                         that heartbeated the lease remains
 *   MUT_READ_BEFORE_CLAIM D reads before P has answered a heartbeat naming
 *                         the lease "held" (P does not know D reads it)
 *   MUT_RENEW_FROM_ARRIVAL D renews a view from when the answer arrives, not
 *                         from when it sent the heartbeat (P's answer tick
 *                         holds answers back)
 * and one that must break the liveness claim L:
 *   MUT_NO_HELLO          D never says hello (so nothing is ever proven)
 */

/* What one exhaustive check covers (the faults together are too many states
 * for one check of under a minute): */
#ifdef SCOPE_NET           /* reorder, duplicate, cut and heal, loss, delay, P forgetting D; stalls, drift */
#define NRANK 1
#define DPN 2
#define PDN 1
#define LN 1
#define NO_Y
#define NO_CRASH
#define NO_RELEASE
#define NO_ABORT
#endif
#ifdef SCOPE_RANKS         /* two TP ranks; loss, delay, stalls (drift: the other scopes) */
#define NRANK 2
#define DRIFT 0
#define DPN 1
#define PDN 1
#define LN 1
#define NO_Y
#define NO_CRASH
#define NO_FORGET
#define NO_RELEASE
#define NO_CUT
#define NO_DUP
#define NO_ABORT
#endif
#ifdef SCOPE_RESTART       /* crash, restart (ours or stock), reconnects, colliding keys; loss, delay, stalls, drift */
#define NRANK 1
#define DPN 1
#define PDN 1
#define LN 1
#define NO_CUT
#define NO_DUP
#define NO_FORGET
#define NO_ABORT
#endif
#ifdef SCOPE_ABORT         /* SCOPE_RESTART's faults with aborts of parked READs and their completions; no drift */
#define NRANK 1
#define DRIFT 0
#define DPN 1
#define PDN 1
#define LN 1
#define NO_CUT
#define NO_DUP
#define NO_FORGET
#endif
#ifdef SCOPE_READERS       /* two requests of D read one lease (r1 shares r0's); another D heartbeats and reads it; loss, delay, stalls */
#define READERS
#define DRIFT 0
#define NO_LOSS
#define NREQ 2
#define NRANK 1
#define DPN 1
#define PDN 1
#define LN 1
#define NO_Y
#define NO_CRASH
#define NO_RELEASE
#define NO_CUT
#define NO_DUP
#define NO_FORGET
#define NO_ABORT
#endif
#ifdef SCOPE_TICK          /* P's answer tick (P3a) with D's asking rule; loss, delay, stalls, drift */
#define PTICK
#define NRANK 1
#define DPN 2
#define PDN 1
#define LN 1
#define NO_Y
#define NO_CRASH
#define NO_RELEASE
#define NO_ABORT
#define NO_CUT
#define NO_DUP
#define NO_FORGET
#endif
#ifdef NOFAULT             /* the liveness claim's schedule: two ranks, two requests, P's answer tick */
#define NREQ 2
#define NO_ABORT
#define PTICK
#endif

#ifndef NRANK
#define NRANK 2            /* TP ranks of P: 1 or 2 */
#endif
#ifndef NREQ
#define NREQ 1             /* D's requests: r0, and with 2 also r1 */
#endif
#define NRQ 2              /* r1's variables exist always; with NREQ 1 P never grants it */
#define NL 3               /* lease slots per rank: r0, r1, Y */
#define YL 2               /* Y's slot */
#define DUR 3              /* P1: a lease starts at now + DUR (P's clock) */
#define EXT 3              /* P2: a heartbeat extends to arrival + EXT */
#define MARGIN 1           /* D5: fence a READ with this little left */
#define TOMB (2 * EXT)     /* P4: tombstones live 2 x extension */
#define ASK_AT 2           /* D3b: D must ask for an answer once its view has this little left */
#ifndef DRIFT
#define DRIFT 1            /* P's clock is off by its offset plus 0..DRIFT */
#endif
#ifndef DPN
#define DPN 2              /* D -> P messages in flight: 1 or 2 */
#endif
#ifndef PDN
#define PDN 2              /* P -> D messages in flight: 1 or 2 */
#endif
#ifndef LN
#define LN 2               /* D's acknowledged heartbeats awaiting answers: 1 or 2 */
#endif

#define ALL_RANKS ((1 << NRANK) - 1)
#define LAST (NRANK - 1)
#define POFF(i) ((i) == 1 -> 2 : 0)           /* each process's clock offset */
#define OLD (EXT + 1)                         /* a send this old can renew nothing */
/* A view this far past its end can never be renewed (a renewal needs a send
 * younger than EXT made before the view's end): it stands for every view
 * ended or lapsed longer ago.  An unconverted deadline keeps more room: the
 * conversion may add up to POFF(1) - POFF(2) + DRIFT. */
#define VFLOOR (-(EXT - 1))
#define PFLOOR (VFLOOR - 2 - DRIFT)
#define KEY(l) ((l) == 1 -> 1 : 0)            /* r0 and Y share key 0 */
#ifdef READERS
#define LS(r) 0                               /* the lease slot request r reads */
#define RKEY(r) 0                             /* the key request r names */
#else
#define LS(r) (r)
#define RKEY(r) KEY(r)
#endif

#define YOK
#define CRASHOK
#define CUTOK
#define DUPOK
#define PDDUPOK
#define FORGETOK
#define RELEASEOK
#define ABORTOK
#define LOSSOK
#ifdef NO_LOSS
#undef LOSSOK
#define LOSSOK false &&
#endif
#ifdef NO_ABORT
#undef ABORTOK
#define ABORTOK false &&
#endif
#ifdef NO_Y
#undef YOK
#define YOK false &&
#endif
#ifdef NO_CRASH
#undef CRASHOK
#define CRASHOK false &&
#endif
#ifdef NO_CUT
#undef CUTOK
#define CUTOK false &&
#endif
#ifdef NO_DUP
#undef DUPOK
#define DUPOK false &&
#endif
#ifdef NO_PDDUP
#undef PDDUPOK
#define PDDUPOK false &&
#endif
#ifdef NO_FORGET
#undef FORGETOK
#define FORGETOK false &&
#endif
#ifdef NO_RELEASE
#undef RELEASEOK
#define RELEASEOK false &&
#endif
#ifdef NOFAULT
#define FAULT false &&
#define TICK_OK timeout
#else
#define FAULT true &&
#define TICK_OK true
#endif

/* D's requests */
#define NONE 0
#define QUEUED 1           /* view held, READ not started (waiting, or for proof) */
#define READING 2
#define READ 3             /* READ completed and kept */
#define FENCED 4           /* failed load: fenced, discarded, or the READ failed */
#define DROPPED 5          /* MUT_DROP_PARKED: forgotten without a report */

/* message kinds */
#define HELLO 1
#define LHB 2              /* LHB: or LHBT: (names collide the same way: reused ids, tags) */
#define COMP 3             /* <id>:<count> outside a READ (abort cleanup, full prefix hit) */

byte skew;

/* ---- P: the running process and its ranks' lease tables ---- */
byte pinst = 1;            /* 0: down */
bool pstock;               /* the running process is stock vLLM */
bool restarted;
bool held[NRANK * NL];
short rem[NRANK * NL];     /* deadline minus now, P's clock (0: due, freed at the next sweep) */
bool amb[NRANK * NL];      /* ambiguous: its key has a tombstone, or a sharer was freed */
byte tomb[NRANK];          /* P's clock left on key 0's tombstone (0: none) */
bool loaded[NRANK];        /* D's agent admitted on this rank (P6) */
/* P3a: answers wait for the rank's answer tick; one slot per rank and request
 * (the newest heartbeat's: an older one's answer would renew less) */
byte pnd_seq[NRANK * NRQ]; /* 0: none waiting */
bool pnd_nh[NRANK * NRQ];
bool ptick[NRANK];         /* the rank's answer tick is due (set every tick) */
bool ygranted;
/* kv_transfer_params of D's requests (through the router) */
byte rinst[NRQ];          /* remote_lease_instance (0: not granted) */
/* SCOPE_READERS: several readers of lease 0 */
short gdl;                 /* remote_lease_deadline minus now, P's clock, until r1 gets r0's params */
byte lclaim;               /* D: the request that claimed lease 0's READ (r + 1; 0: none) */
byte rdc;                  /* the completion D's READ carries, in flight to P (the READ's instance; 0: none) */
bool hb_a, hb_b;           /* P: D (agent a) / another D (agent b) heartbeated lease 0 */
bool b_done;               /* the other D's READ of lease 0 completed (its completion reached P) */
bool a_done;               /* P: D's completion left lease 0 held for the other D (D is no holder since) */
bool vack[NRQ];           /* D: P answered a heartbeat naming the request's key "held" (P knows D reads it) */

/* ---- network: a bag; a D -> P message goes to every rank in its mask ---- */
bool link_up = 1;
byte dp_kind[2];
byte dp_inst[2];         /* the process whose agents it is addressed to */
byte dp_mask[2];
byte dp_seq[2];          /* LHB: its sequence number (SEQ); COMP: the instance whose lease it means (ghost) */
byte dp_key[2];
bool pd_used[2];
byte pd_inst[2];         /* sender's process (its agent) and the instance the answer names */
byte pd_rank[2];
byte pd_seq[2];          /* 0: the welcome */
bool pd_nh[2];           /* the key was not (unambiguously) held */

/* ---- D ---- */
byte dq[NRQ];
/* The view: its deadline minus now.  Until D converts it (vconv), that is
 * remote_lease_deadline minus now on the granting process's clock. */
short vrem[NRQ];
bool vconv[NRQ];
bool rd_ok[NRQ];          /* ghost: the READ reached the granting process, which held it throughout */
byte pdl[NRQ];            /* a posted READ: its view's deadline at the post, minus now (0: passed) */
bool conn;                 /* upstream's connection to the engine (_remote_agents[E]) */
byte cinst;                /* the process that connection reaches (its agents) */
byte cskew;                /* P's skew at its handshake (the offset measured is POFF(cinst) + cskew) */
byte proven[NRANK];        /* the instance each agent of it answered with (0: none) */
bool hb_due[NRQ];         /* this tick's heartbeat, scheduler -> worker */
bool dblk[NRQ];           /* D's KV blocks for the request: held until D reports it (finished_recving) */
bool hello_due = 1;        /* hello_retry_s */
/* A heartbeat's sequence number names its send: SEQ(age, r), the request and
 * how long ago it was sent (at most one per request per tick, so a number never
 * names two live sends; every copy of it ages together, up to OLD). */
#define SEQ(age, r) ((age) * 2 + (r) + 1)
#define SEQ_AGE(q) (((q) - 1) / 2)
#define SEQ_R(q) (((q) - 1) % 2)
#define AGED(q) ((q) == 0 -> 0 : (SEQ_AGE(q) < OLD -> (q) + 2 : (q)))
byte lg_seq[2];           /* 0: free */
byte lg_mask[2];          /* ranks that have not answered */
bool lg_nh[2];
bool lg_none[2];          /* answered by another process: proves nothing */
#ifdef MUT_REMEMBERED_CAPS
byte eng_proven;
#endif

/* scratch: every atomic step leaves them 0 */
byte i, j, k, l, m_kind, m_inst, m_seq, m_key, m_rank, m_nh, m_s, pstep;
bool comp_ok, dblk_back;

/* Bags are kept canonical (slot 0 fills first): the order of slots means nothing. */
inline dp_compact()
{
  if
  :: dp_mask[0] == 0 && dp_mask[1] != 0 ->
     dp_kind[0] = dp_kind[1]; dp_inst[0] = dp_inst[1]; dp_mask[0] = dp_mask[1]; dp_seq[0] = dp_seq[1]; dp_key[0] = dp_key[1];
     dp_kind[1] = 0; dp_inst[1] = 0; dp_mask[1] = 0; dp_seq[1] = 0; dp_key[1] = 0
  :: dp_mask[0] == 0 && dp_mask[1] == 0 -> dp_kind[0] = 0; dp_inst[0] = 0; dp_seq[0] = 0; dp_key[0] = 0;
     dp_kind[1] = 0; dp_inst[1] = 0; dp_seq[1] = 0; dp_key[1] = 0
  :: dp_mask[0] != 0 && dp_mask[1] == 0 -> dp_kind[1] = 0; dp_inst[1] = 0; dp_seq[1] = 0; dp_key[1] = 0
  :: else
  fi
}

inline pd_compact()
{
  if
  :: !pd_used[0] && pd_used[1] ->
     pd_used[0] = 1; pd_inst[0] = pd_inst[1]; pd_rank[0] = pd_rank[1]; pd_seq[0] = pd_seq[1]; pd_nh[0] = pd_nh[1];
     pd_used[1] = 0; pd_inst[1] = 0; pd_rank[1] = 0; pd_seq[1] = 0; pd_nh[1] = 0
  :: else
  fi
}

/* ---- proof (AckRequester.proof) ---- */
#define PROVEN_AS(I) (proven[0] == (I) && proven[LAST] == (I))
#define OTHER_THAN(I) ((proven[0] != 0 && proven[0] != (I)) || (proven[LAST] != 0 && proven[LAST] != (I)))
#ifdef MUT_NO_EPOCH
#define SENDABLE(r) (proven[0] != 0 && proven[LAST] != 0)
#define READABLE(r) SENDABLE(r)
#define FENCE_OTHER(r) false
#elif defined(MUT_REMEMBERED_CAPS)
#define SENDABLE(r) (PROVEN_AS(rinst[r]) || eng_proven == rinst[r])
#define READABLE(r) SENDABLE(r)
#define FENCE_OTHER(r) (OTHER_THAN(rinst[r]) && eng_proven != rinst[r])
#else
#define SENDABLE(r) PROVEN_AS(rinst[r])
#define READABLE(r) PROVEN_AS(rinst[r])
#define FENCE_OTHER(r) OTHER_THAN(rinst[r])
#endif
/* R10 (SCOPE_READERS): D reads a lease only once P has answered a heartbeat
 * naming it "held": P then counts D among the lease's agents, and frees on
 * another D's completion only at expiry */
#if defined(READERS) && !defined(MUT_READ_BEFORE_CLAIM)
#define P_KNOWS(r) vack[r]
#else
#define P_KNOWS(r) true
#endif
#define MAY_READ(r) (vrem[r] > MARGIN)
/* a request D is done with keeps no view (canonical states) */
inline rem_d_done(r)
{
  if :: dq[r] >= READ -> vrem[r] = 0; vconv[r] = 0; vack[r] = 0 :: else fi;
  if :: dq[r] == READ || dq[r] == FENCED -> dblk[r] = 0 :: else fi   /* reported */
}
/* LeaseViews._local: P's deadline on D's clock, converted with the connection's offset */
#define CONV(r) (vrem[r] + POFF(rinst[r]) + skew - POFF(cinst) - cskew)
#define CONVERTED(r) (CONV(r) < VFLOOR -> VFLOOR : CONV(r))
#define HELD_ALL(l) (held[l] && held[LAST * NL + (l)])

/* ================= the clock ================= */
active proctype Clock()
{
end:
  do
  :: atomic { TICK_OK ->
       pstep = 1;
       if
       :: skew > 0 -> skew--; pstep = 0
       :: true
       :: skew < DRIFT -> skew++; pstep = 2
       fi;
       /* P's timers, on P's clock */
       i = 0;
       do
       :: i < NRANK * NL -> if :: held[i] -> rem[i] = (rem[i] - pstep < 0 -> 0 : rem[i] - pstep) :: else fi; i++
       :: else -> i = 0; break
       od;
       tomb[0] = (tomb[0] < pstep -> 0 : tomb[0] - pstep);
       tomb[LAST] = (tomb[LAST] < pstep -> 0 : tomb[LAST] - pstep);
       vrem[0] = (rinst[0] != 0 && !vconv[0] && dq[0] <= READING -> (vrem[0] - pstep < PFLOOR -> PFLOOR : vrem[0] - pstep) : vrem[0]);
       vrem[1] = (rinst[1] != 0 && !vconv[1] && dq[1] <= READING -> (vrem[1] - pstep < PFLOOR -> PFLOOR : vrem[1] - pstep) : vrem[1]);
#ifdef READERS
       gdl = (rinst[0] != 0 && rinst[1] == 0 -> (gdl - pstep < PFLOOR -> PFLOOR : gdl - pstep) : gdl);
#endif
       printf("EV tick (P clock +%d)\n", pstep);
       pstep = 0;
       /* D's timers */
       vrem[0] = (vconv[0] && vrem[0] > VFLOOR -> vrem[0] - 1 : vrem[0]);
       vrem[1] = (vconv[1] && vrem[1] > VFLOOR -> vrem[1] - 1 : vrem[1]);
       pdl[0] = (pdl[0] > 0 -> pdl[0] - 1 : 0); pdl[1] = (pdl[1] > 0 -> pdl[1] - 1 : 0);
       rem_d_done(0); rem_d_done(1);
       /* D's blocks come back once D has nothing left of a request (vLLM frees
        * them on the worker's report) */
       dblk_back = !(dq[0] > READING && dblk[0]) && !(dq[1] > READING && dblk[1]);
       assert(dblk_back);
       /* every copy of a heartbeat's number ages; AckLedger.prune: a send older
        * than EXT could move no view */
       i = 0;
       do
       :: i < LN -> lg_seq[i] = AGED(lg_seq[i]);
                    if :: lg_seq[i] != 0 && SEQ_AGE(lg_seq[i]) > EXT ->
                            lg_seq[i] = 0; lg_mask[i] = 0; lg_nh[i] = 0; lg_none[i] = 0
                       :: else fi; i++
       :: else -> i = 0; break
       od;
       dp_seq[0] = (dp_kind[0] == LHB -> AGED(dp_seq[0]) : dp_seq[0]);
       dp_seq[1] = (dp_kind[1] == LHB -> AGED(dp_seq[1]) : dp_seq[1]);
       pd_seq[0] = AGED(pd_seq[0]);
       pd_seq[1] = AGED(pd_seq[1]);
#ifdef PTICK
       pnd_seq[0] = AGED(pnd_seq[0]); pnd_seq[1] = AGED(pnd_seq[1]);
       pnd_seq[LAST * NRQ] = AGED(pnd_seq[LAST * NRQ]); pnd_seq[LAST * NRQ + 1] = AGED(pnd_seq[LAST * NRQ + 1]);
       ptick[0] = 1; ptick[LAST] = 1;
#endif
       /* the scheduler's heartbeat tick (heartbeat_schedule.py) */
       hb_due[0] = (dq[0] == QUEUED); hb_due[1] = (dq[1] == QUEUED);
       hello_due = 1 }
  od
}

/* ================= P ================= */
inline grant(l)
{
  k = 0;
  do
  :: k < NRANK ->
     held[k * NL + l] = 1; rem[k * NL + l] = DUR;
#ifndef MUT_NO_TOMBSTONES
     amb[k * NL + l] = (KEY(l) == 0 && tomb[k] > 0);
#endif
     k++
  :: else -> k = 0; break
  od
}

inline free_lease(k, l)
{
  held[k * NL + l] = 0; rem[k * NL + l] = 0; amb[k * NL + l] = 0;
  if :: LS(0) == l && dq[0] == READING -> rd_ok[0] = 0 :: else fi;
  if :: NREQ > 1 && LS(1) == l && dq[1] == READING -> rd_ok[1] = 0 :: else fi;
#ifndef MUT_NO_TOMBSTONES
  if
  :: KEY(l) == 0 ->
     tomb[k] = TOMB;
     /* P4: a live lease still sharing the freed key is ambiguous */
     if :: l != 0 && held[k * NL] -> amb[k * NL] = 1 :: else fi;
     if :: l != YL && held[k * NL + YL] -> amb[k * NL + YL] = 1 :: else fi
  :: else
  fi
#endif
}

/* the P scheduler: grants (p_scheduler/lease_params.py), process crash and restart */
active proctype Psched()
{
end:
  do
  :: atomic { pinst == 1 && rinst[0] == 0 ->
       grant(0); rinst[0] = pinst; vrem[0] = DUR;
#ifdef READERS
       gdl = DUR;
#endif
       printf("EV P%d grants r0\n", pinst) }
#ifdef READERS
  /* a second request of D carries r0's params (n > 1, a retry, a duplicate) */
  :: atomic { rinst[0] != 0 && rinst[1] == 0 -> rinst[1] = rinst[0]; vrem[1] = gdl; gdl = 0; printf("EV D gets r1 with r0's params\n") }
#elif NREQ > 1
  :: atomic { pinst != 0 && !pstock && rinst[0] != 0 && rinst[1] == 0 ->
       grant(1); rinst[1] = pinst; vrem[1] = DUR }
#endif
  :: atomic { FAULT YOK pinst != 0 && !pstock && !ygranted -> ygranted = 1; grant(YL); printf("EV P%d grants Y (the key of r0)\n", pinst) }
  :: atomic { FAULT CRASHOK pinst == 1 ->
       /* kill -9: every block is gone with the process, every READ to it fails */
       printf("EV P1 crashes\n");
       pinst = 0;
       k = 0;
       do
       :: k < NRANK * NL -> held[k] = 0; rem[k] = 0; amb[k] = 0; k++
       :: else -> k = 0; break
       od;
       tomb[0] = 0; tomb[LAST] = 0; loaded[0] = 0; loaded[LAST] = 0;
       k = 0;
       do
       :: k < NRANK * NRQ -> pnd_seq[k] = 0; pnd_nh[k] = 0; k++
       :: else -> k = 0; break
       od;
       if :: dq[0] == READING && cinst == 1 -> dq[0] = FENCED; pdl[0] = 0 :: else fi;
       if :: dq[1] == READING && cinst == 1 -> dq[1] = FENCED; pdl[1] = 0 :: else fi }
  :: atomic { FAULT pinst == 0 && !restarted ->
       /* the same engine id, a new process: a new instance (A5) */
       restarted = 1; pinst = 2;
       if :: pstock = 0 :: pstock = 1 fi;
       printf("EV P restarts: instance 2, stock=%d\n", pstock) }
  od
}

inline p_answer(k, s, nh)
{
  if
  :: !pd_used[0] -> pd_used[0] = 1; pd_inst[0] = pinst; pd_rank[0] = k; pd_seq[0] = s; pd_nh[0] = nh
  :: PDN > 1 && pd_used[0] && !pd_used[1] -> pd_used[1] = 1; pd_inst[1] = pinst; pd_rank[1] = k; pd_seq[1] = s; pd_nh[1] = nh
  :: else    /* nothing free: lost */
  fi
}

#define HOLDS(k, key) ((key == 0 && (held[k * NL] || held[k * NL + YL])) || (key == 1 && held[k * NL + 1]))
#ifdef MUT_NO_TOMBSTONES
#define AMBIGUOUS(k, key) false
#else
#define AMBIGUOUS(k, key) (key == 0 && ((held[k * NL] && amb[k * NL]) || (held[k * NL + YL] && amb[k * NL + YL])))
#endif

/* one rank's NIXL notifications (p_worker/ack_answerer.py, lease_keeper.py) */
inline p_recv(k, i)
{
  atomic { link_up && (dp_mask[i] & (1 << k)) &&
#ifdef NOFAULT
           (!pd_used[0] || (PDN > 1 && !pd_used[1])) &&
#endif
           true ->
    m_kind = dp_kind[i]; m_inst = dp_inst[i]; m_seq = dp_seq[i]; m_key = dp_key[i];
    dp_mask[i] = dp_mask[i] & ~(1 << k);
    dp_compact();
    if
    :: m_inst != pinst -> skip      /* addressed to a dead process's agent */
    :: m_inst == pinst && pstock ->
       /* our hello is behind the HB:, escape: stock takes it for a heartbeat
        * naming none of its leases.  LHB:/LHBT: must never reach it. */
       assert(m_kind != LHB)
    :: m_inst == pinst && !pstock && m_kind == COMP ->
       /* a completion frees the lease its id names here: on the process that
        * granted it, D's own lease; on another, a colliding id's (Y) */
       l = (m_seq == pinst -> m_key : (m_key == 0 -> YL : NL));
       if
       :: l < NL && held[k * NL + l] ->
          comp_ok = (m_seq == pinst);
          printf("EV P%d rank %d frees lease %d on a completion meant for P%d\n", pinst, k, l, m_seq);
          assert(comp_ok); free_lease(k, l); comp_ok = 0
       :: else
       fi;
       l = 0
    :: m_inst == pinst && !pstock && m_kind == HELLO ->
       /* P6/P7: admitted if it names a lease held here; welcomed at once */
       if
       :: loaded[k] || HOLDS(k, m_key) -> loaded[k] = 1; p_answer(k, 0, 0); printf("EV P%d rank %d admits hello, welcomes\n", pinst, k)
       :: else    /* refused */
       fi
    :: m_inst == pinst && !pstock && m_kind == LHB ->
#ifdef READERS
       hb_a = hb_a || (m_key == 0 && held[k * NL] && !a_done);
#endif
       /* P2: extend every lease the key names, before the sweep */
       l = 0;
       do
       :: l < NL -> if :: held[k * NL + l] && KEY(l) == m_key && rem[k * NL + l] < EXT ->
                            rem[k * NL + l] = EXT
                          :: else fi; l++
       :: else -> l = 0; break
       od;
       /* P3: the answer, "held" only if held and not ambiguous, waits for the
        * rank's tick (P3a); seq 0 wants none (P3b) */
       if
       :: loaded[k] && m_seq != 0 ->
#ifdef PTICK
          pnd_seq[k * NRQ + SEQ_R(m_seq)] = m_seq; pnd_nh[k * NRQ + SEQ_R(m_seq)] = !HOLDS(k, m_key) || AMBIGUOUS(k, m_key);
#else
          p_answer(k, m_seq, !HOLDS(k, m_key) || AMBIGUOUS(k, m_key));
#endif
          printf("EV P%d rank %d gets LHB (sent %d ago), answers not-held=%d\n", pinst, k, SEQ_AGE(m_seq), !HOLDS(k, m_key) || AMBIGUOUS(k, m_key))
       :: else       /* no hello admitted, or no answer wanted */
       fi
    fi;
    m_kind = 0; m_inst = 0; m_seq = 0; m_key = 0 }
}

/* P3a: on the rank's tick, every waiting answer goes out in one step */
#ifdef NOFAULT
#define PD_FREE ((!pd_used[0] -> 1 : 0) + (PDN > 1 && !pd_used[1] -> 1 : 0))
#define PND_FITS(k) ((pnd_seq[(k) * NRQ] != 0 -> 1 : 0) + (pnd_seq[(k) * NRQ + 1] != 0 -> 1 : 0) <= PD_FREE)
#else
#define PND_FITS(k) true
#endif
inline p_tick(k)
{
  atomic { ptick[k] && (pnd_seq[k * NRQ] != 0 || pnd_seq[k * NRQ + 1] != 0) && PND_FITS(k) ->
    ptick[k] = 0;
    if
    :: loaded[k] ->
       if :: pnd_seq[k * NRQ] != 0 -> p_answer(k, pnd_seq[k * NRQ], pnd_nh[k * NRQ]) :: else fi;
       if :: pnd_seq[k * NRQ + 1] != 0 -> p_answer(k, pnd_seq[k * NRQ + 1], pnd_nh[k * NRQ + 1]) :: else fi;
       printf("EV P%d rank %d answers on its tick\n", pinst, k)
    :: else    /* forgotten since: dropped */
    fi;
    pnd_seq[k * NRQ] = 0; pnd_nh[k * NRQ] = 0; pnd_seq[k * NRQ + 1] = 0; pnd_nh[k * NRQ + 1] = 0 }
}

inline p_expire(k, l)
{
  atomic { held[k * NL + l] && rem[k * NL + l] <= 0 -> free_lease(k, l); printf("EV P%d rank %d frees lease %d (expired)\n", pinst, k, l) }
}

#ifdef MUT_FREE_ON_FIRST_COMPLETION
#define FREE_ON_COMPLETION(other) true
#else
#define FREE_ON_COMPLETION(other) (!(other))
#endif

proctype Pworker(byte rank)
{
end:
  do
  :: p_recv(rank, 0)
  :: p_recv(rank, 1)
#ifdef PTICK
  :: p_tick(rank)
#endif
  :: p_expire(rank, 0)
  :: p_expire(rank, 1)
  :: p_expire(rank, YL)
  /* another D heartbeats Y: every lease its key names is extended */
  :: atomic { FAULT held[rank * NL + YL] ->
       l = 0;
       do
       :: l < NL -> if :: held[rank * NL + l] && KEY(l) == 0 && rem[rank * NL + l] < EXT ->
                            rem[rank * NL + l] = EXT
                          :: else fi; l++
       :: else -> l = 0; break
       od }
#ifdef READERS
  /* D's READ completion, and the other D's: P frees lease 0 on one only when
   * no other agent that heartbeated it remains (else at expiry).  P14
   * (claim_gate.py): a holder whose completion leaves the lease held for
   * another leaves, and a heartbeat of it after that makes it no holder again */
  :: atomic { rdc != 0 ->
       if
       :: rdc == pinst && held[rank * NL] && FREE_ON_COMPLETION(hb_b) ->
          free_lease(rank, 0); printf("EV P%d frees lease 0 on D's completion\n", pinst)
       :: rdc == pinst && held[rank * NL] && !FREE_ON_COMPLETION(hb_b) ->
          hb_a = 0; a_done = 1; printf("EV P%d keeps lease 0 for the other D; D leaves\n", pinst)
       :: else
       fi;
       rdc = 0 }
  :: atomic { FAULT held[rank * NL] ->
       rem[rank * NL] = (rem[rank * NL] < EXT -> EXT : rem[rank * NL]); hb_b = hb_b || !b_done }
  :: atomic { FAULT held[rank * NL] && !b_done -> b_done = 1;
       if
       :: FREE_ON_COMPLETION(hb_a) -> free_lease(rank, 0); printf("EV P%d frees lease 0 on the other D's completion\n", pinst)
       :: else -> hb_b = 0
       fi }
#endif
  /* P9 / eviction: P forgets D's agent */
  :: atomic { FAULT FORGETOK loaded[rank] -> loaded[rank] = 0; printf("EV P rank %d forgets the agent of D\n", rank) }
  od
}

init
{
  atomic {
    run Pworker(0);
#if NRANK > 1
    run Pworker(1);
#endif
  }
}

/* ================= D ================= */
/* the scheduler: admits requests from their own params, schedules heartbeats
 * (d_scheduler/lease_view_collector.py, heartbeat_schedule.py) */
active proctype Dsched()
{
end:
  do
  :: atomic { dq[0] == NONE && rinst[0] != 0 -> dq[0] = QUEUED; hb_due[0] = 1; dblk[0] = 1 }
  :: atomic { dq[1] == NONE && rinst[1] != 0 -> dq[1] = QUEUED; hb_due[1] = 1; dblk[1] = 1 }
  od
}

inline d_send(kind, mask, s, key)
{
  if
  :: dp_mask[0] == 0 -> dp_kind[0] = kind; dp_inst[0] = cinst; dp_mask[0] = mask; dp_seq[0] = s; dp_key[0] = key
  :: DPN > 1 && dp_mask[0] != 0 && dp_mask[1] == 0 -> dp_kind[1] = kind; dp_inst[1] = cinst; dp_mask[1] = mask; dp_seq[1] = s; dp_key[1] = key
  :: else    /* nothing free: lost */
  fi
}

#ifdef NOFAULT
#define DP_ROOM (dp_mask[0] == 0 || (DPN > 1 && dp_mask[1] == 0))
#else
#define DP_ROOM true
#endif

/* D2: hello to the agents that have not proven r's instance */
inline d_hello(r)
{
  atomic {
#ifdef MUT_NO_HELLO
    false &&
#endif
    conn && hello_due && dq[r] == QUEUED && !PROVEN_AS(rinst[r]) && DP_ROOM ->
    hello_due = 0;
    printf("EV D says hello to P%d for r%d\n", cinst, r);
    d_send(HELLO, (proven[0] != rinst[r] -> 1 : 0) | (proven[LAST] != rinst[r] -> 1 << LAST : 0), 0, RKEY(r)) }
}

/* D3b: D must ask for an answer while its view is not converted, has ASK_AT
 * or less left, or (R10) P has not yet answered it "held"; otherwise it may
 * send LHB with seq 0, which P extends and does not answer (the code asks in
 * a subset of those states too: the model lets D choose) */
#define MUST_ASK(r) (!vconv[r] || vrem[r] <= ASK_AT || !P_KNOWS(r))
inline d_unasked(r)
{
  atomic { conn && hb_due[r] && dq[r] == QUEUED && SENDABLE(r) && DP_ROOM && !MUST_ASK(r) ->
    hb_due[r] = 0;
    d_send(LHB, ALL_RANKS, 0, RKEY(r));
    printf("EV D sends LHB for r%d to P%d asking no answer (view %d left)\n", r, cinst, vrem[r]) }
}

/* D3: LHB over a connection proven r's instance, recorded in the ledger */
inline d_heartbeat(r)
{
  atomic { conn && hb_due[r] && dq[r] == QUEUED && SENDABLE(r) && DP_ROOM ->
    hb_due[r] = 0;
    /* a full ledger forgets its oldest send (an answer to it is then ignored) */
    if
    :: LN == 1 || lg_seq[0] == 0 || (lg_seq[1] != 0 && lg_seq[0] > lg_seq[1]) -> i = 0
    :: else -> i = 1
    fi;
    lg_seq[i] = SEQ(0, r); lg_mask[i] = ALL_RANKS; lg_nh[i] = 0; lg_none[i] = 0; i = 0;
    d_send(LHB, ALL_RANKS, SEQ(0, r), RKEY(r));
    printf("EV D sends LHB for r%d to P%d (view %d left)\n", r, cinst, vrem[r]);
#ifdef MUT_RENEW_ON_SEND
    if :: vconv[r] && vrem[r] > MARGIN && vrem[r] < EXT -> vrem[r] = EXT; printf("EV D renews the view of r%d on send\n", r) :: else fi;
#endif
  }
}

/* read_fence.py: the verdict, then the READ */
/* LeaseViews._local: P's deadline on D's clock, with the connection's offset */
inline d_convert(r)
{
  atomic { conn && dq[r] == QUEUED && !vconv[r] -> vrem[r] = CONVERTED(r); vconv[r] = 1 }
}

/* D5: fenced (a failed load) when the connection proved another instance, or too little is left */
inline d_fence(r)
{
  atomic { conn && dq[r] == QUEUED && vconv[r] && (FENCE_OTHER(r) || !MAY_READ(r)) -> dq[r] = FENCED }
}

/* R9 (read_claims.py): D posts at most one READ per lease; the first request
 * to read claims it, and every other local request of the lease is fenced */
#if defined(READERS) && !defined(MUT_TWO_READS)
#define CLAIMED_BY_OTHER(r) (lclaim != 0 && lclaim != (r) + 1)
#else
#define CLAIMED_BY_OTHER(r) false
#endif

/* D5: read over a connection proven r's instance (unproven: the READ waits) */
inline d_start(r)
{
  atomic { conn && dq[r] == QUEUED && vconv[r] && !FENCE_OTHER(r) && READABLE(r) && MAY_READ(r) && P_KNOWS(r) ->
    if
    :: cinst != pinst -> dq[r] = FENCED   /* the process is gone: the READ fails */
    :: cinst == pinst && CLAIMED_BY_OTHER(r) -> dq[r] = FENCED; printf("EV D fences r%d: r%d claimed the lease\n", r, lclaim - 1)
    :: else ->
#ifdef READERS
       lclaim = r + 1;
#endif
       dq[r] = READING; rd_ok[r] = (rinst[r] == pinst && HELD_ALL(LS(r))); pdl[r] = vrem[r];
       printf("EV D starts READ of r%d from P%d (view %d left)\n", r, cinst, vrem[r])
    fi }
}

/* D sees the READ complete: discard_late keeps it if seen before the deadline
 * it was posted with minus the margin, or while its view has more than the
 * margin left (the margin covers the clocks' error at completion too) */
#ifdef MUT_NO_COMPLETION_MARGIN
#define KEEP(r) (vrem[r] > 0 || pdl[r] > 0)
#else
#define KEEP(r) (vrem[r] > MARGIN || pdl[r] > MARGIN)
#endif
inline d_done(r)
{
  atomic { dq[r] == READING ->
    pdl[r] = 0;
#ifdef READERS
    rdc = cinst;   /* NIXL delivers the READ's completion notification after its data */
#endif
    if
    :: !KEEP(r) -> dq[r] = FENCED
    :: else ->
       /* S: no READ completes over blocks P freed or another process holds */
       printf("EV the READ of r%d completes (view %d left)\n", r, vrem[r]);
       assert(rd_ok[r]); dq[r] = READ
    fi;
    rd_ok[r] = 0 }
}

/* The client aborts a request whose READ waits (parked: queued, unproven or
 * not yet started): D reports it failed at once (its blocks come back), and
 * sends P its completion only over a connection proven its instance.  An
 * aborted posted READ is not modelled apart: it completes or fails, and is
 * handled as any READ (d_done). */
#ifdef MUT_COMP_ANY_CONN
#define COMP_TO(r) conn
#else
#define COMP_TO(r) (conn && PROVEN_AS(rinst[r]))
#endif
inline d_abort(r)
{
  atomic { FAULT ABORTOK dq[r] == QUEUED ->
    printf("EV the client aborts r%d\n", r);
#ifdef MUT_DROP_PARKED
    dq[r] = DROPPED;
#else
    dq[r] = FENCED;
#endif
    if
    :: COMP_TO(r) -> d_send(COMP, ALL_RANKS, rinst[r], RKEY(r)); printf("EV D sends r%d's completion to P%d\n", r, cinst)
    :: else
    fi }
}

/* ack_requester.received: one answer */
inline d_answer(i)
{
  atomic { link_up && pd_used[i] ->
    m_inst = pd_inst[i]; m_rank = pd_rank[i]; m_seq = pd_seq[i]; m_nh = pd_nh[i];
    pd_used[i] = 0; pd_inst[i] = 0; pd_rank[i] = 0; pd_seq[i] = 0; pd_nh[i] = 0;
    pd_compact();
    if
    :: conn && cinst == m_inst ->
       proven[m_rank] = m_inst;
       printf("EV D gets an answer from P%d rank %d (welcome=%d not-held=%d)\n", m_inst, m_rank, m_seq == 0, m_nh);
#ifdef MUT_REMEMBERED_CAPS
       if :: PROVEN_AS(m_inst) -> eng_proven = m_inst :: else fi;
#endif
#ifndef MUT_NO_EPOCH
       /* D4: the connection proves another instance: those views end */
       if
       :: PROVEN_AS(m_inst) ->
          if :: rinst[0] != m_inst -> vrem[0] = VFLOOR; vconv[0] = 1 :: else fi;
          if :: rinst[1] != m_inst -> vrem[1] = VFLOOR; vconv[1] = 1 :: else fi
       :: else
       fi;
#endif
       j = 0;
       do
       :: j < LN && lg_seq[j] != 0 && lg_seq[j] == m_seq && (lg_mask[j] & (1 << m_rank)) ->
          lg_mask[j] = lg_mask[j] & ~(1 << m_rank);
          if :: m_nh -> lg_nh[j] = 1 :: else fi;
#ifndef MUT_NO_EPOCH
          if :: m_inst != rinst[SEQ_R(m_seq)] -> lg_none[j] = 1 :: else fi;
#endif
          if
          :: lg_mask[j] == 0 ->
             l = SEQ_R(m_seq);
             if
             :: lg_none[j] -> skip
             :: !lg_none[j] && lg_nh[j] -> vrem[l] = VFLOOR; vconv[l] = 1   /* not held: the view ends */
             :: !lg_none[j] && !lg_nh[j] ->
#ifdef READERS
                vack[l] = 1;
#endif
                if :: !vconv[l] -> vrem[l] = CONVERTED(l); vconv[l] = 1 :: else fi;
                /* 4.1: renew only a view alive at the send (sent before its end),
                 * to send + EXT, from a send younger than EXT */
                m_s = SEQ_AGE(m_seq);
                if
#ifdef MUT_RENEW_FROM_ARRIVAL
                :: vrem[l] + m_s > 0 && EXT > vrem[l] && m_s < EXT -> vrem[l] = EXT;
                   printf("EV D renews the view of r%d to %d (from the arrival)\n", SEQ_R(m_seq), EXT)
#else
                :: vrem[l] + m_s > 0 && EXT - m_s > vrem[l] && m_s < EXT -> vrem[l] = EXT - m_s;
                   printf("EV D renews the view of r%d to %d\n", SEQ_R(m_seq), EXT - m_s)
#endif
                :: else
                fi;
                m_s = 0
             fi;
             lg_seq[j] = 0; lg_nh[j] = 0; lg_none[j] = 0; l = 0
          :: else
          fi;
          j = 0; break
       :: j < LN && !(lg_seq[j] != 0 && lg_seq[j] == m_seq && (lg_mask[j] & (1 << m_rank))) -> j++
       :: j >= LN -> j = 0; break
       od
    :: else    /* not an agent of the current connection: proves nothing */
    fi;
    m_inst = 0; m_rank = 0; m_seq = 0; m_nh = 0 }
}

/* the worker: handshake, hellos, heartbeats, answers, READs
 * (d_worker/heartbeat_sender.py, ack_requester.py, read_fence.py) */
active proctype Dworker()
{
end:
  do
  /* upstream's NIXL handshake with whichever process serves the engine id now */
  :: atomic { !conn && pinst != 0 && link_up ->
       conn = 1; cinst = pinst; cskew = skew; proven[0] = 0; proven[LAST] = 0;
       printf("EV D handshakes with P%d\n", pinst) }
  /* upstream releases the connection (a failed send, an invalid engine, a repeated handshake, a silent P: D2a) */
  :: atomic { FAULT RELEASEOK conn -> printf("EV D releases its connection\n"); conn = 0; cinst = 0; cskew = 0; proven[0] = 0; proven[LAST] = 0 }
  /* rehello to a proven agent (P may have forgotten it) */
  :: atomic { FAULT conn && hello_due && dq[0] == QUEUED && PROVEN_AS(rinst[0]) ->
       hello_due = 0; d_send(HELLO, ALL_RANKS, 0, 0) }
  :: d_hello(0)
  :: d_hello(1)
  :: d_heartbeat(0)
  :: d_heartbeat(1)
  :: d_unasked(0)
  :: d_unasked(1)
  :: d_convert(0)
  :: d_convert(1)
  :: d_fence(0)
  :: d_fence(1)
  :: d_start(0)
  :: d_start(1)
  :: d_done(0)
  :: d_done(1)
  :: d_answer(0)
  :: d_answer(1)
  :: d_abort(0)
  :: d_abort(1)
  od
}

/* ================= the network's faults ================= */
active proctype Net()
{
end:
  do
  :: atomic { FAULT CUTOK link_up -> link_up = 0; printf("EV link cut\n") }
  :: atomic { FAULT !link_up -> link_up = 1; printf("EV link healed\n") }
  /* loss: one rank's copy of a D -> P message, or a P -> D message */
  :: atomic { FAULT LOSSOK dp_mask[0] & 1 -> dp_mask[0] = dp_mask[0] & ~1; dp_compact(); printf("EV network loses a D->P message\n") }
  :: atomic { FAULT LOSSOK dp_mask[0] & (1 << LAST) -> dp_mask[0] = dp_mask[0] & ~(1 << LAST); dp_compact(); printf("EV network loses a D->P message\n") }
  :: atomic { FAULT LOSSOK dp_mask[1] & 1 -> dp_mask[1] = dp_mask[1] & ~1; dp_compact(); printf("EV network loses a D->P message\n") }
  :: atomic { FAULT LOSSOK dp_mask[1] & (1 << LAST) -> dp_mask[1] = dp_mask[1] & ~(1 << LAST); dp_compact(); printf("EV network loses a D->P message\n") }
  :: atomic { FAULT LOSSOK pd_used[0] -> pd_used[0] = 0; pd_inst[0] = 0; pd_rank[0] = 0; pd_seq[0] = 0; pd_nh[0] = 0; pd_compact(); printf("EV network loses a P->D message\n") }
  :: atomic { FAULT LOSSOK pd_used[1] -> pd_used[1] = 0; pd_inst[1] = 0; pd_rank[1] = 0; pd_seq[1] = 0; pd_nh[1] = 0; printf("EV network loses a P->D message\n") }
  /* duplication: a second copy of a message in flight */
  :: atomic { FAULT DUPOK DPN > 1 && dp_mask[0] != 0 && dp_mask[1] == 0 ->
       dp_kind[1] = dp_kind[0]; dp_inst[1] = dp_inst[0]; dp_mask[1] = dp_mask[0]; dp_seq[1] = dp_seq[0]; dp_key[1] = dp_key[0] }
  :: atomic { FAULT DUPOK PDDUPOK PDN > 1 && pd_used[0] && !pd_used[1] ->
       pd_used[1] = 1; pd_inst[1] = pd_inst[0]; pd_rank[1] = pd_rank[0]; pd_seq[1] = pd_seq[0]; pd_nh[1] = pd_nh[0] }
  od
}

/* L: with no faults, every queued request is read */
ltl L { [] ((dq[0] == QUEUED -> <> (dq[0] == READ)) && (dq[1] == QUEUED -> <> (dq[1] == READ))) }
