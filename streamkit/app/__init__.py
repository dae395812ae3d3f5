"""The consumer application runtime: shards, transactions, and their assignment."""
