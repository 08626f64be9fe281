//! `gguf FILE`: print a GGUF file's header, metadata and tensor table.
//! `gguf FILE --tensor NAME [--values N]`: statistics (and the first values) of one tensor.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Parser;
use loader::GgmlType;
use loader::gguf::{GgufFile, TensorInfo, Value};
use serde_json::json;

#[derive(Parser)]
#[command(about = "Inspect a GGUF file: header, metadata, tensors, tensor statistics")]
struct Args {
    /// The GGUF file.
    file: PathBuf,
    /// Print dequantized statistics of this tensor instead of the file overview.
    #[arg(long)]
    tensor: Option<String>,
    /// With --tensor: also print the first N values.
    #[arg(long, requires = "tensor")]
    values: Option<usize>,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
    /// Array items shown per metadata array.
    #[arg(long, default_value_t = 8)]
    max_items: usize,
    /// Characters shown per metadata string.
    #[arg(long, default_value_t = 100)]
    max_chars: usize,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let file = GgufFile::open(&args.file).context("cannot read the GGUF file")?;
    match &args.tensor {
        Some(name) => tensor_report(&args, &file, name),
        None if args.json => {
            println!(
                "{}",
                serde_json::to_string_pretty(&overview_json(&args, &file))?
            );
            Ok(())
        }
        None => {
            print_overview(&args, &file);
            Ok(())
        }
    }
}

/// Per-type totals: tensor count, bytes, elements.
fn totals(file: &GgufFile) -> BTreeMap<GgmlType, (usize, u64, u64)> {
    let mut by_type = BTreeMap::new();
    for t in &file.tensors {
        let e = by_type.entry(t.ty).or_insert((0, 0, 0));
        e.0 += 1;
        e.1 += t.n_bytes;
        e.2 += t.n_elements();
    }
    by_type
}

fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut x = n as f64;
    let mut unit = 0;
    while x >= 1024.0 && unit + 1 < UNITS.len() {
        x /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{x:.2} {}", UNITS[unit])
    }
}

fn clip(s: &str, max_chars: usize) -> String {
    match s.char_indices().nth(max_chars) {
        Some((cut, _)) => format!("{:?}… ({} bytes)", &s[..cut], s.len()),
        None => format!("{s:?}"),
    }
}

fn value_text(v: &Value, args: &Args) -> String {
    match v {
        Value::String(s) => clip(s, args.max_chars),
        Value::Array(_, items) => {
            let shown: Vec<String> = items
                .iter()
                .take(args.max_items)
                .map(|i| value_text(i, args))
                .collect();
            if items.len() > args.max_items {
                format!("[{}, …] ({} items)", shown.join(", "), items.len())
            } else {
                format!("[{}]", shown.join(", "))
            }
        }
        Value::U8(x) => x.to_string(),
        Value::I8(x) => x.to_string(),
        Value::U16(x) => x.to_string(),
        Value::I16(x) => x.to_string(),
        Value::U32(x) => x.to_string(),
        Value::I32(x) => x.to_string(),
        Value::U64(x) => x.to_string(),
        Value::I64(x) => x.to_string(),
        Value::F32(x) => format!("{x:?}"),
        Value::F64(x) => format!("{x:?}"),
        Value::Bool(x) => x.to_string(),
    }
}

fn type_text(v: &Value) -> String {
    match v {
        Value::Array(t, items) => match items.first() {
            Some(inner @ Value::Array(..)) => format!("array<{}>", type_text(inner)),
            _ => format!("array<{t}>"),
        },
        other => other.value_type().to_string(),
    }
}

fn value_json(v: &Value, args: &Args) -> serde_json::Value {
    match v {
        Value::String(s) if s.chars().count() > args.max_chars => {
            json!({ "truncated": s.chars().take(args.max_chars).collect::<String>(), "bytes": s.len() })
        }
        Value::String(s) => json!(s),
        Value::Array(_, items) => {
            let shown: Vec<_> = items
                .iter()
                .take(args.max_items)
                .map(|i| value_json(i, args))
                .collect();
            if items.len() > args.max_items {
                json!({ "first": shown, "count": items.len() })
            } else {
                json!(shown)
            }
        }
        Value::U8(x) => json!(x),
        Value::I8(x) => json!(x),
        Value::U16(x) => json!(x),
        Value::I16(x) => json!(x),
        Value::U32(x) => json!(x),
        Value::I32(x) => json!(x),
        Value::U64(x) => json!(x),
        Value::I64(x) => json!(x),
        Value::F32(x) => json!(x),
        Value::F64(x) => json!(x),
        Value::Bool(x) => json!(x),
    }
}

fn print_overview(args: &Args, file: &GgufFile) {
    println!("file         {}", file.path().display());
    println!("version      {}", file.version);
    println!("alignment    {}", file.alignment);
    println!("keys         {}", file.metadata.len());
    println!("tensors      {}", file.tensors.len());
    println!("data offset  {}", file.data_offset);
    println!(
        "file size    {} ({})",
        file.file_size(),
        human_bytes(file.file_size())
    );

    println!("\nmetadata:");
    let key_w = file
        .metadata
        .iter()
        .map(|(k, _)| k.len())
        .max()
        .unwrap_or(0);
    for (key, value) in file.metadata.iter() {
        let ty = type_text(value);
        println!("  {key:key_w$}  {ty:14}  {}", value_text(value, args));
    }

    println!("\ntensors:");
    let name_w = file
        .tensors
        .iter()
        .map(|t| t.name.len())
        .max()
        .unwrap_or(4)
        .max(4);
    let ne_text = |t: &TensorInfo| format!("{:?}", t.ne);
    let ne_w = file
        .tensors
        .iter()
        .map(|t| ne_text(t).len())
        .max()
        .unwrap_or(2)
        .max(2);
    println!(
        "  {:name_w$}  {:ne_w$}  {:6}  {:>12}  {:>12}",
        "name", "ne", "type", "bytes", "offset"
    );
    for t in &file.tensors {
        println!(
            "  {:name_w$}  {:ne_w$}  {:6}  {:>12}  {:>12}",
            t.name,
            ne_text(t),
            t.ty.name(),
            t.n_bytes,
            t.offset
        );
    }

    println!("\ntotals:");
    let (mut n, mut bytes, mut params) = (0, 0, 0);
    for (ty, (count, b, e)) in totals(file) {
        println!(
            "  {:6}  {count:5} tensors  {:>12}  {e:>14} params",
            ty.name(),
            human_bytes(b)
        );
        n += count;
        bytes += b;
        params += e;
    }
    println!(
        "  {:6}  {n:5} tensors  {:>12}  {params:>14} params",
        "all",
        human_bytes(bytes)
    );
}

fn overview_json(args: &Args, file: &GgufFile) -> serde_json::Value {
    let metadata: Vec<_> = file
        .metadata
        .iter()
        .map(|(k, v)| json!({ "key": k, "type": type_text(v), "value": value_json(v, args) }))
        .collect();
    let tensors: Vec<_> = file
        .tensors
        .iter()
        .map(|t| {
            json!({ "name": t.name, "ne": t.ne, "type": t.ty.name(), "bytes": t.n_bytes, "offset": t.offset })
        })
        .collect();
    let by_type: serde_json::Map<_, _> = totals(file)
        .into_iter()
        .map(|(ty, (n, b, e))| {
            (
                ty.name().to_string(),
                json!({ "tensors": n, "bytes": b, "params": e }),
            )
        })
        .collect();
    json!({
        "file": file.path(),
        "version": file.version,
        "alignment": file.alignment,
        "n_kv": file.metadata.len(),
        "n_tensors": file.tensors.len(),
        "data_offset": file.data_offset,
        "file_size": file.file_size(),
        "metadata": metadata,
        "tensors": tensors,
        "totals": {
            "by_type": by_type,
            "params": file.tensors.iter().map(TensorInfo::n_elements).sum::<u64>(),
            "bytes": file.tensors.iter().map(|t| t.n_bytes).sum::<u64>(),
        },
    })
}

struct Stats {
    n: usize,
    non_finite: usize,
    min: f64,
    max: f64,
    mean: f64,
    std: f64,
    rms: f64,
}

/// Over the finite values; non-finite ones are only counted.
fn stats(values: &[f32]) -> Stats {
    let (mut n_fin, mut sum, mut sum_sq) = (0usize, 0f64, 0f64);
    let (mut min, mut max) = (f64::INFINITY, f64::NEG_INFINITY);
    for &x in values.iter().filter(|x| x.is_finite()) {
        let x = x as f64;
        n_fin += 1;
        sum += x;
        sum_sq += x * x;
        min = min.min(x);
        max = max.max(x);
    }
    let (mean, rms) = if n_fin > 0 {
        (sum / n_fin as f64, (sum_sq / n_fin as f64).sqrt())
    } else {
        (f64::NAN, f64::NAN)
    };
    // Two-pass variance: the one-pass formula cancels badly when |mean| ≫ std.
    let var = values
        .iter()
        .filter(|x| x.is_finite())
        .map(|&x| (x as f64 - mean).powi(2))
        .sum::<f64>()
        / n_fin.max(1) as f64;
    Stats {
        n: values.len(),
        non_finite: values.len() - n_fin,
        min,
        max,
        mean,
        std: var.sqrt(),
        rms,
    }
}

fn tensor_report(args: &Args, file: &GgufFile, name: &str) -> Result<()> {
    let info = file
        .tensor(name)
        .with_context(|| format!("{}: no tensor named `{name}`", file.path().display()))?;
    let values = file.dequantize(name).context("cannot dequantize")?;
    let s = stats(&values);
    let first = &values[..args.values.unwrap_or(0).min(values.len())];
    if args.json {
        let mut out = json!({
            "name": info.name, "ne": info.ne, "type": info.ty.name(), "bytes": info.n_bytes,
            "offset": info.offset, "n": s.n, "min": s.min, "max": s.max, "mean": s.mean,
            "std": s.std, "rms": s.rms, "non_finite": s.non_finite,
        });
        if args.values.is_some() {
            out["values"] = json!(first);
        }
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!("tensor      {}", info.name);
    println!("ne          {:?} (shape {:?})", info.ne, info.shape());
    println!("type        {}", info.ty);
    println!(
        "bytes       {} at data offset {}",
        info.n_bytes, info.offset
    );
    println!("n           {}", s.n);
    println!("min         {:e}", s.min);
    println!("max         {:e}", s.max);
    println!("mean        {:e}", s.mean);
    println!("std         {:e}", s.std);
    println!("rms         {:e}", s.rms);
    println!("non-finite  {}", s.non_finite);
    if !first.is_empty() {
        println!("first {}:", first.len());
        for row in first.chunks(8) {
            let cells: Vec<String> = row.iter().map(|x| format!("{x:>14.7e}")).collect();
            println!("  {}", cells.join(" "));
        }
    }
    Ok(())
}
