"""Developer tools, apart from the product: the fault run and its audit (``chaos``,
``chaos_audit``), the record fuzzer (``fuzz``) and the benchmarks (``bench``). They stand on the
application (they start jobs and brokers through it); the application imports them only to offer
their commands on the ``rlstream`` command line."""
