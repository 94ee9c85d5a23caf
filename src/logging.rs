//! The one logging switch of the library and its programs: `SNOWRDMA_LOG`
//! (`env_logger` filter syntax, e.g. `warn` or `snowrdma=debug`), else
//! `RUST_LOG`, else the caller's default.

/// The variable every program and the C library read first.
pub const LOG_ENV: &str = "SNOWRDMA_LOG";

/// Installs a logger on stderr with the filter from [`LOG_ENV`], else
/// `RUST_LOG`, else `default` (`None`: no logger at all then). Does nothing
/// when a logger is already installed.
pub fn init_logging(default: Option<&str>) {
    let filter = std::env::var(LOG_ENV)
        .or_else(|_| std::env::var("RUST_LOG"))
        .ok()
        .or_else(|| default.map(str::to_string));
    if let Some(filter) = filter {
        let _ = env_logger::Builder::new().parse_filters(&filter).try_init();
    }
}
