"""Developer tooling, never imported by the engine's runtime path: local Kafka
(`localkafka`, its files in `kafkaconfig`, its secured mode in `kafkasecurity`),
PostgreSQL (`localpg`) and Spark standalone (`localspark`, `sparkdaemons`,
`sparkstate`) servers on 127.0.0.1 sharing `localproc`'s process handling, TLS
material (`tlsgen`), the demo, docgen, the chaos harness and the seeded workload
generator (`testing`)."""
