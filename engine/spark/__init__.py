"""The Spark side: `job` runs the Structured Streaming query (Kafka source,
read_committed, one micro-batch at a time handed to the runtime); `jars` resolves
the JVM jars Spark and the local broker need from Maven Central."""
