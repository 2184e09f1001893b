//! What the tick ledger warns the operator about, read from its log. Alone in its test
//! binary: a thread-local tracing subscriber is not reliable beside tests that run the
//! same log statements on other threads.

use std::io::Write;
use std::sync::{Arc, Mutex};

use chosen_apalis::TickLedger;
use chosen_tests::{PgCluster, connect_admin, unique_name};
use deadpool_postgres::Pool;

#[derive(Clone, Default)]
struct Lines(Arc<Mutex<Vec<u8>>>);

impl Write for Lines {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test(flavor = "current_thread")]
async fn tables_of_one_name_in_several_schemas_are_warned_about() {
    // Nodes whose search_path differs would each find their own ledger: whoever sees
    // several tables of the default names says so, naming them.
    let lines = Lines::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer({
            let lines = lines.clone();
            move || lines.clone()
        })
        .with_ansi(false)
        .with_max_level(tracing::Level::WARN)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let pg = PgCluster::start().unwrap();
    let admin = connect_admin(&pg.url()).await.unwrap();
    let pool = |url: &str| {
        let config: tokio_postgres::Config = url.parse().unwrap();
        Pool::builder(deadpool_postgres::Manager::new(
            config,
            tokio_postgres::NoTls,
        ))
        .max_size(1)
        .build()
        .unwrap()
    };
    TickLedger::new(pool(&pg.url())).install().await.unwrap();
    let schema = unique_name("shadow").replace('-', "_");
    admin
        .batch_execute(&format!(
            "CREATE SCHEMA {schema};\nCREATE TABLE {schema}.chosen_ticks (LIKE public.chosen_ticks INCLUDING ALL);\nCREATE TABLE {schema}.chosen_fence (LIKE public.chosen_fence INCLUDING ALL)"
        ))
        .await
        .unwrap();
    tracing::callsite::rebuild_interest_cache();
    TickLedger::new(pool(&pg.url())).install().await.unwrap();
    let text = String::from_utf8(lines.0.lock().unwrap().clone()).unwrap();
    assert!(
        text.contains("tables of this name exist in several schemas")
            && text.contains(&format!("{schema}.chosen_ticks"))
            && text.contains("public.chosen_ticks"),
        "{text}"
    );
}
