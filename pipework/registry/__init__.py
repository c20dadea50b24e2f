"""The composition layer: the register centre (pipes, chains and routes) and the TOML
gateway file that builds it, with its engine, container and backends."""
