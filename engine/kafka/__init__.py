"""Kafka clients: `connection` (the typed `kafka:` settings: `KafkaConnection`,
secrets as SecretStr, rendered for librdkafka or Java where a client is built),
`io` (topics, metadata, reads to the end, delivery reports) and `transactions`
(`TransactionalWriter`: the one owner of a transactional producer, whose every
outcome is committed, fenced, timed out or failed)."""
