"""The pipeline stages, and one decode step through them.

Modules: ``prefetch`` (the plan: hits, misses, evictions, read-ahead; the only writer of cache
state), ``read`` (I/O lanes doing positioned reads, scheduled by ``ReadQueue``), ``ready`` (the
wait that gives a layer back to compute once its bytes are in place), ``bind`` (regions the expert
tensors point at), ``compute`` (the decode driver on its own thread), ``predict`` (the next
layer's router applied early) and ``dense`` (dense weights copied out of the file mapping).
``bmoe.engine.streaming.Streamer`` builds them for a session, with the gate, from one
``ComputeModes`` value (``bmoe.pipeline.boundary``); a trace replay builds the same stages over a
simulated residency and reader.

One decode step (threads: the compute thread runs ``llama_decode``; the event loop runs the
stage coroutines; the lane threads run the reads):

1. compute (``ComputeStage``, loop): arms the routing gate for this call and starts
   ``llama_decode`` on the compute thread; the call owns the stage tasks that serve it.
2. callback (``bmoe.llama.callback.EvalCallback``, compute thread): asked about every graph node;
   the first 8 bytes of the name say whether it is a MoE node at all. At ``ffn_moe_topk-<il>`` the
   routed ids are read by strides and handed to the gate.
3. gate (``bmoe.pipeline.gate.RoutingGate``, compute thread): if every routed expert of the layer is
   resident (``FastPath.resident``, the per-layer map the ready stage keeps), return at once: no
   event, no hop (the layer goes on ``FastPath.hits`` for the cache writer to account). Else
   post a ``RoutingEvent`` on the events channel (``GateItem``s) and block on its reply.
4. prefetch (``PrefetchStage``, loop): plans the event against the ``ExpertCache``: hits, misses,
   evictions (only now, while the compute thread waits, so no page goes away under a running
   matmul). Evicted experts' pages go to the misses (``Residency.reuse``) or back to the kernel;
   misses become ``ReadRequest``s, projection by projection in graph order, each with a readiness
   future; read-ahead for later layers is admitted after the real reads, never before them.
5. read (``ReadStage``, loop + lanes): lanes take the requests in batches (real before speculative:
   ``ReadQueue``) and read each slice straight into its region; each completion resolves its
   future.
6. ready (``ReadyStage``, loop): waits for the layer's futures (serial mode) or for the
   projection the next matmul consumes (overlap mode), marks the experts resident in the map the
   gate reads, and replies.
7. reply (gate -> callback, compute thread): the callback returns True and the expert matmuls run
   on the bytes now in place. A failure anywhere is recorded, the callback ends the graph at the
   next node it waits at, and the compute stage raises it instead of emitting a token.
8. end of the call (loop): the cache trims back under its budget and the next call may start.
"""
