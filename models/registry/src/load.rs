//! Opening a checkpoint for the binaries and tests: path resolution, schema check, the
//! config.json cross-check, the declaration, tokenizer and chat template.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use engine::Model;
use indicatif::{ProgressBar, ProgressStyle};
use loader::chat::ChatTemplate;
use loader::gguf::GgufFile;
use loader::release::Release;
use loader::tokenizer::Tokenizer;

/// Everything a binary needs to run a checkpoint.
pub struct Loaded {
    pub model: Arc<Model>,
    pub tokenizer: Option<Tokenizer>,
    pub chat_template: Option<ChatTemplate>,
    pub release: Option<Release>,
    pub gguf_path: PathBuf,
}

/// Opens `gguf` (+ the release directory, when there is one) and checks it.
pub fn load(gguf_path: &Path, release_dir: Option<&Path>, progress: bool) -> Result<Loaded> {
    let gguf =
        GgufFile::open(gguf_path).with_context(|| format!("opening {}", gguf_path.display()))?;
    let hparams = crate::check_schema(&gguf.metadata, &gguf.tensors).with_context(|| {
        format!(
            "{} does not match its architecture's schema",
            gguf_path.display()
        )
    })?;
    let release = match release_dir {
        Some(dir) => Some(
            Release::open(dir)
                .with_context(|| format!("reading the release directory {}", dir.display()))?,
        ),
        None => None,
    };
    if let Some(cfg) = release.as_ref().and_then(|r| r.config.as_ref()) {
        loader::release::cross_check(&gguf.metadata, cfg).with_context(|| {
            format!(
                "{} disagrees with config.json in {}",
                gguf_path.display(),
                release_dir
                    .map(|d| d.display().to_string())
                    .unwrap_or_default()
            )
        })?;
    }
    let tokenizer = match release.as_ref().and_then(|r| r.tokenizer_json.clone()) {
        Some(p) => {
            Some(Tokenizer::from_file(&p).with_context(|| format!("loading {}", p.display()))?)
        }
        None => Tokenizer::from_gguf(&gguf.metadata).ok(),
    };
    let template_src = release
        .as_ref()
        .and_then(|r| r.chat_template.clone())
        .or_else(|| {
            gguf.metadata
                .get_str("tokenizer.chat_template")
                .ok()
                .map(str::to_string)
        });
    let chat_template = match template_src {
        Some(src) => Some(ChatTemplate::new(&src).context("compiling the chat template")?),
        None => None,
    };
    if progress {
        prefault(&gguf);
    }
    let decl = crate::declaration(&hparams, release.as_ref())?;
    Ok(Loaded {
        model: Arc::new(Model::new(gguf, hparams, decl)),
        tokenizer,
        chat_template,
        release,
        gguf_path: gguf_path.to_path_buf(),
    })
}

/// Touches every page of the weights once, with a progress bar, so the first
/// token does not pay the page faults.
fn prefault(gguf: &GgufFile) {
    let total: u64 = gguf.tensors.iter().map(|t| t.n_bytes).sum();
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template("loading {bar:40} {bytes}/{total_bytes} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut sink = 0u8;
    for t in &gguf.tensors {
        let data = gguf.tensor_data(t);
        for page in data.chunks(4096) {
            sink ^= page[0];
        }
        bar.inc(t.n_bytes);
    }
    std::hint::black_box(sink);
    bar.finish_and_clear();
}

/// Resolves `--model` / `--tokenizer-path` to a GGUF file and a release directory.
pub fn resolve(
    model: Option<&Path>,
    tokenizer_path: Option<&Path>,
) -> Result<(PathBuf, Option<PathBuf>)> {
    let Some(model) = model else {
        bail!("no --model given");
    };
    let r = loader::release::resolve(Some(model), tokenizer_path)?;
    Ok((r.gguf, Some(r.release_dir)))
}
