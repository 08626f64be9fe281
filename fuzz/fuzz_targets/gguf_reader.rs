//! Any bytes as a GGUF file: the reader either refuses them with an error or yields a file
//! whose every tensor slice, metadata value and GGUF-vocabulary tokenizer can be used without a
//! panic (small tensors are dequantized too).
#![no_main]

use libfuzzer_sys::fuzz_target;
use loader::gguf::GgufFile;
use loader::tokenizer::Tokenizer;

fuzz_target!(|data: &[u8]| {
    let Ok(f) = GgufFile::from_bytes("fuzz.gguf", data.to_vec()) else {
        return;
    };
    for t in &f.tensors {
        let bytes = f.tensor_data(t);
        std::hint::black_box(bytes.len());
        let elements: u64 = t.ne.iter().product();
        if elements <= 1 << 16 {
            let _ = f.dequantize(&t.name);
        }
    }
    if let Ok(tok) = Tokenizer::from_gguf(&f.metadata) {
        if let Ok(ids) = tok.encode("Hello <_end> world", true) {
            let _ = tok.decode(&ids, false);
        }
    }
});
