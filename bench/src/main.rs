//! `pmem-csi-bench`: runs the benchmarks, writes `bench/results/<date>-<sha>.json` with raw
//! samples and the machine, renders BENCHMARKS.md from the committed results, and checks that
//! the committed BENCHMARKS.md is what the results render to.

mod cluster_scale;
mod driver_ops;
mod end_to_end;
mod faults;
mod filter_floor;
mod http_load;
mod memory;
mod report;
mod resident;
mod webhook_load;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Parser, Subcommand};
use report::{Benchmark, Machine, Results, Target};

#[global_allocator]
static ALLOCATOR: resident::Counting = resident::Counting;

#[derive(Parser, Debug)]
#[command(name = "pmem-csi-bench")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run every benchmark. Without --smoke: write a result file, render BENCHMARKS.md and
    /// fail when a target is missed.
    Run {
        /// Small scale, no result file, no targets: only proves the benchmarks still run.
        #[arg(long)]
        smoke: bool,
        /// Samples per benchmark (full runs).
        #[arg(long, default_value_t = 5)]
        samples: usize,
        /// Run only the node driver benchmarks and print them; no result file (experiments).
        #[arg(long)]
        driver_only: bool,
        /// Run only the webhook (`mutate`) or extender (`filter`, with its floor) load; without
        /// --smoke, write `bench/results/<date>-<sha>-<mutate|filter>.json` and render
        /// BENCHMARKS.md (failing when a target is missed).
        #[arg(long, value_parser = ["mutate", "filter"])]
        load_only: Option<String>,
        /// Run only the end-to-end benchmarks (pod start-up, storage-bound A/B) and print them;
        /// no result file (experiments).
        #[arg(long)]
        e2e_only: bool,
        /// Run only the node's apiserver cost (orphan sweep, heartbeat); without --smoke, write
        /// `bench/results/<date>-<sha>-sweep.json` and render BENCHMARKS.md.
        #[arg(long)]
        sweep_only: bool,
        /// Run only the memory benchmarks (controller after its first pass, node driver idle
        /// and with volumes, extender at scale); without --smoke, write
        /// `bench/results/<date>-<sha>-memory.json` and render BENCHMARKS.md.
        #[arg(long)]
        memory_only: bool,
        /// Run only the pod start-up burst under several csi-provisioner and
        /// kube-controller-manager settings (the shipped ones first); without --smoke, write `bench/results/<date>-<sha>-startup-<nodes>.json`
        /// and render BENCHMARKS.md.
        #[arg(long)]
        startup_sweep: bool,
        /// Nodes of --startup-sweep.
        #[arg(long, default_value_t = 10)]
        sweep_nodes: usize,
        /// Pods (each with a claim) of --startup-sweep.
        #[arg(long, default_value_t = 100)]
        sweep_pods: usize,
        /// Only these settings of --startup-sweep (labels, comma-separated; `shipped` first).
        #[arg(long, value_delimiter = ',')]
        sweep_settings: Vec<String>,
    },
    /// Turn the fault suite's figures (`just faults`) into `bench/results/<date>-<sha>-faults.json`
    /// and render BENCHMARKS.md.
    ImportFaults {
        /// The figures file the runs of `e2e/tests/faults.rs` appended to.
        figures: PathBuf,
    },
    /// Render BENCHMARKS.md from bench/results/.
    Render,
    /// Fail when BENCHMARKS.md differs from what bench/results/ renders to.
    Check,
    /// Serve the floor of the extender's `/filter` (bench/src/filter_floor.rs) for the load
    /// benchmark, which starts it.
    #[command(hide = true)]
    FilterFloor {
        /// Listen address.
        #[arg(long)]
        address: std::net::SocketAddr,
        /// Nodes in its table (`webhook_load::node_name` of 0..nodes).
        #[arg(long)]
        nodes: usize,
    },
}

/// The repository root: the working directory (`just` runs recipes there), so that a binary
/// reused from a shared target directory never writes into another checkout.
fn repo_root() -> anyhow::Result<PathBuf> {
    let dir = std::env::current_dir().context("current directory")?;
    anyhow::ensure!(
        dir.join("bench/results").is_dir(),
        "run from the repository root (no bench/results in {})",
        dir.display()
    );
    Ok(dir)
}

/// Writes `benchmarks` as a result file of this commit (`<date>-<sha>.json`, or
/// `<date>-<sha>-<what>.json` for results of another kind), renders BENCHMARKS.md, and fails
/// when a target is missed.
fn publish(root: &Path, benchmarks: Vec<Benchmark>, what: Option<&str>) -> anyhow::Result<()> {
    let results_dir = root.join("bench/results");
    let markdown = root.join("BENCHMARKS.md");
    let results = Results {
        date: report::today()?,
        sha: report::git_sha(root)?,
        timestamp: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        machine: Machine::current(),
        benchmarks,
    };
    let path = match what {
        Some(what) => results.write_named(&results_dir, what)?,
        None => results.write(&results_dir)?,
    };
    println!("wrote {}", path.display());
    std::fs::write(&markdown, report::render(&results_dir)?)
        .with_context(|| format!("writing {}", markdown.display()))?;
    let missed = results.missed();
    anyhow::ensure!(missed.is_empty(), "targets missed: {}", missed.join("; "));
    Ok(())
}

/// Prints p50, p99 and max of each benchmark (experiment runs, no result file).
fn print_quantiles(benchmarks: &[Benchmark]) {
    for b in benchmarks {
        println!(
            "{}: p50 {:.3} p99 {:.3} max {:.3} {}",
            b.name,
            report::quantile(&b.samples, 0.5),
            report::quantile(&b.samples, 0.99),
            report::quantile(&b.samples, 1.0),
            b.unit
        );
    }
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,kube_client=off".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    if let Command::FilterFloor { address, nodes } = cli.command {
        let runtime = tokio::runtime::Runtime::new().context("tokio runtime")?;
        return runtime.block_on(filter_floor::serve(address, nodes, webhook_load::node_name));
    }
    let root = repo_root()?;
    let results_dir = root.join("bench/results");
    let markdown = root.join("BENCHMARKS.md");
    match cli.command {
        Command::Run {
            smoke,
            samples,
            driver_only,
            load_only,
            e2e_only,
            sweep_only,
            memory_only,
            startup_sweep,
            sweep_nodes,
            sweep_pods,
            sweep_settings,
        } => {
            let samples = if smoke { 1 } else { samples.max(1) };
            let runtime = tokio::runtime::Runtime::new().context("tokio runtime")?;
            let e2e = if smoke {
                end_to_end::Scale::smoke()
            } else {
                end_to_end::Scale::full()
            };
            if e2e_only {
                let mut benchmarks = runtime.block_on(end_to_end::pod_startup(&e2e))?;
                benchmarks.extend(runtime.block_on(end_to_end::storage_bound(&e2e))?);
                print_quantiles(&benchmarks);
                for b in &benchmarks {
                    println!("{}: {}", b.name, b.description);
                }
                return Ok(());
            }
            if sweep_only {
                let (volumes, pvs, window) = if smoke {
                    (20, 200, Duration::from_secs(5))
                } else {
                    (500, 10_000, Duration::from_secs(60))
                };
                let benchmarks = runtime.block_on(async {
                    let env = testenv::TestEnv::builder()
                        .start()
                        .await
                        .context("starting testenv")?;
                    let out = cluster_scale::sweep_cost(&env, &root, volumes, pvs, window).await;
                    let leftovers = env.stop().await;
                    let remaining = leftovers.wait_clean(Duration::from_secs(20)).await;
                    anyhow::ensure!(remaining.is_empty(), "left behind: {remaining:?}");
                    out
                })?;
                print_quantiles(&benchmarks);
                for b in &benchmarks {
                    println!("{}: {}", b.name, b.flags);
                }
                if !smoke {
                    publish(&root, benchmarks, Some("sweep"))?;
                }
                return Ok(());
            }
            if startup_sweep {
                let scale = if smoke {
                    end_to_end::Scale::smoke()
                } else {
                    end_to_end::Scale::startup(sweep_nodes, sweep_pods)
                };
                let settings: Vec<_> = end_to_end::StartupSetting::sweep()
                    .into_iter()
                    .filter(|s| sweep_settings.is_empty() || sweep_settings.contains(&s.label))
                    .collect();
                let benchmarks = runtime.block_on(end_to_end::startup_sweep(&scale, &settings))?;
                print_quantiles(&benchmarks);
                if !smoke {
                    publish(&root, benchmarks, Some(&format!("startup-{sweep_nodes}")))?;
                }
                return Ok(());
            }
            if memory_only {
                let scale = if smoke {
                    memory::Scale::smoke()
                } else {
                    memory::Scale::full()
                };
                let benchmarks = runtime.block_on(memory::run(&root, &scale))?;
                print_quantiles(&benchmarks);
                for b in &benchmarks {
                    println!("{}: {}", b.name, b.flags);
                }
                if !smoke {
                    publish(&root, benchmarks, Some("memory"))?;
                }
                return Ok(());
            }
            if let Some(which) = load_only {
                let scale = if smoke {
                    webhook_load::Scale::smoke()
                } else {
                    webhook_load::Scale::full()
                };
                let benchmarks = if which == "mutate" {
                    runtime.block_on(webhook_load::mutate(&scale))?
                } else {
                    runtime.block_on(webhook_load::filter(&scale))?
                };
                print_quantiles(&benchmarks);
                if !smoke {
                    publish(&root, benchmarks, Some(&which))?;
                }
                return Ok(());
            }
            let tools = testenv::Tools::locate().context("locating tools")?;
            let driver_samples = if smoke { 20 } else { samples.max(1) * 100 };
            let mut benchmarks =
                runtime.block_on(driver_ops::run(tools.pmem_csi(), &root, driver_samples))?;
            if driver_only {
                print_quantiles(&benchmarks);
                return Ok(());
            }
            benchmarks.push(runtime.block_on(testenv_startup(samples))?);
            benchmarks.extend(runtime.block_on(async {
                let env = testenv::TestEnv::builder()
                    .start()
                    .await
                    .context("starting testenv")?;
                let memory = if smoke {
                    memory::Scale::smoke()
                } else {
                    memory::Scale::full()
                };
                let mut out = memory::on(&env, &root, &memory).await?;
                out.push(
                    cluster_scale::capacity_latency(&env, &root, if smoke { 5 } else { 200 })
                        .await?,
                );
                let (volumes, pvs, window) = if smoke {
                    (20, 200, Duration::from_secs(5))
                } else {
                    (500, 10_000, Duration::from_secs(60))
                };
                out.extend(cluster_scale::sweep_cost(&env, &root, volumes, pvs, window).await?);
                let leftovers = env.stop().await;
                let remaining = leftovers.wait_clean(Duration::from_secs(20)).await;
                anyhow::ensure!(remaining.is_empty(), "left behind: {remaining:?}");
                anyhow::Ok(out)
            })?);
            let load = if smoke {
                webhook_load::Scale::smoke()
            } else {
                webhook_load::Scale::full()
            };
            benchmarks.extend(runtime.block_on(webhook_load::mutate(&load))?);
            benchmarks.extend(runtime.block_on(webhook_load::filter(&load))?);
            benchmarks.extend(runtime.block_on(end_to_end::startup_sweep(
                &e2e,
                &end_to_end::StartupSetting::sweep(),
            ))?);
            benchmarks.extend(runtime.block_on(end_to_end::storage_bound(&e2e))?);
            if smoke {
                for b in &benchmarks {
                    println!("smoke: {} ran, {} samples", b.name, b.samples.len());
                }
                return Ok(());
            }
            publish(&root, benchmarks, None)?;
        }
        Command::ImportFaults { figures } => {
            let text = std::fs::read_to_string(&figures)
                .with_context(|| format!("reading {}", figures.display()))?;
            publish(&root, faults::import(&text)?, Some("faults"))?;
        }
        Command::Render => {
            std::fs::write(&markdown, report::render(&results_dir)?)
                .with_context(|| format!("writing {}", markdown.display()))?;
        }
        Command::Check => {
            let want = report::render(&results_dir)?;
            let have = std::fs::read_to_string(&markdown)
                .with_context(|| format!("reading {}", markdown.display()))?;
            anyhow::ensure!(
                want == have,
                "BENCHMARKS.md is not what bench/results/ renders to; run `just bench-render`"
            );
            println!("BENCHMARKS.md matches bench/results/");
        }
        // Served before the repository root is needed.
        Command::FilterFloor { .. } => {}
    }
    Ok(())
}

/// Seconds from nothing to a ready 3-node control plane (etcd, apiserver, KCM, scheduler,
/// Node and CSINode objects), and for a graceful teardown that leaves nothing behind. Every
/// integration-test binary pays the start-up once.
async fn testenv_startup(samples: usize) -> anyhow::Result<Benchmark> {
    let mut start_s = Vec::new();
    let mut stop_s = Vec::new();
    for _ in 0..samples {
        let t = Instant::now();
        let env = testenv::TestEnv::builder()
            .nodes(3)
            .start()
            .await
            .context("starting testenv")?;
        start_s.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        let leftovers = env.stop().await;
        let remaining = leftovers.wait_clean(Duration::from_secs(20)).await;
        stop_s.push(t.elapsed().as_secs_f64());
        anyhow::ensure!(remaining.is_empty(), "left behind: {remaining:?}");
    }
    Ok(Benchmark {
        name: "testenv-startup".into(),
        description: "3-node testenv from nothing to ready (seconds); teardown in `secondary`"
            .into(),
        unit: "s".into(),
        samples: start_s,
        secondary: stop_s,
        target: Target {
            p50_max: Some(10.0),
            ..Target::none()
        },
        flags: serde_json::json!({"nodes": 3, "bindTimeoutSeconds": 30}),
    })
}
