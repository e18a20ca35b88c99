"""pdserve's serving benchmark: load a running router, measure what its clients see.

The modules split the job by role:

* ``workloads`` builds the requests (synthetic lengths, a ShareGPT file, shared prefixes,
  a long/short mix), ``arrivals`` the times they are sent at (Poisson, gamma, all at once);
* ``client`` fires them at a router over grpc.aio and records every streamed chunk;
* ``metrics`` turns records into TTFT, TPOT, ITL, E2E, throughput and goodput (pure
  functions), ``sweep`` searches request rates against SLOs;
* ``report`` writes the summary table and the JSON, ``plots`` the PNG figures;
* ``scenarios`` launch the local clusters they compare and run the workloads above;
* ``cli`` is the ``pdserve bench`` and ``pdserve bench-scenario`` front end.
"""
