"""Developer tooling, never imported by the engine's runtime path: local Kafka
(`localkafka`), PostgreSQL (`localpg`) and Spark standalone (`localspark`) servers
on 127.0.0.1, TLS material (`tlsgen`), the demo, docgen, the chaos harness and the
seeded workload generator (`testing`)."""
