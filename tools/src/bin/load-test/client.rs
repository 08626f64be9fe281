//! A minimal blocking HTTP/1.1 client over `std::net`, enough for the OpenAI endpoints of
//! `serve`: a JSON request, and a body read whole or piece by piece (chunked or not) so that
//! SSE events can be timed as they arrive. Shared with the serve tests.

#![allow(dead_code)]

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        header(&self.headers, name)
    }
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

enum Framing {
    Chunked { left: usize },
    Length(usize),
    UntilClose,
}

/// An open response whose body has not been read yet.
pub struct Conn {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    reader: BufReader<TcpStream>,
    framing: Framing,
    done: bool,
}

fn bad(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

/// `addr` is `host:port`. Sends `Connection: close`, so one request per connection.
pub fn send(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> io::Result<Conn> {
    let mut stream = TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(Duration::from_secs(120)))?;
    stream.set_nodelay(true)?;
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    if !headers
        .iter()
        .any(|(k, _)| k.eq_ignore_ascii_case("content-type"))
        && !body.is_empty()
    {
        head.push_str("Content-Type: application/json\r\n");
    }
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes())?;
    stream.write_all(body)?;
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse::<u16>().ok())
        .ok_or_else(|| bad(format!("bad status line {line:?}")))?;
    let mut headers = Vec::new();
    loop {
        line.clear();
        if reader.read_line(&mut line)? == 0 {
            return Err(bad("the connection closed inside the response head"));
        }
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            headers.push((k.trim().to_string(), v.trim().to_string()));
        }
    }
    let framing = if header(&headers, "transfer-encoding")
        .is_some_and(|v| v.eq_ignore_ascii_case("chunked"))
    {
        Framing::Chunked { left: 0 }
    } else if let Some(n) = header(&headers, "content-length").and_then(|v| v.parse().ok()) {
        Framing::Length(n)
    } else {
        Framing::UntilClose
    };
    Ok(Conn {
        status,
        headers,
        reader,
        framing,
        done: false,
    })
}

impl Conn {
    /// The next piece of the body as it arrives; `None` at its end.
    pub fn read_some(&mut self) -> io::Result<Option<Vec<u8>>> {
        if self.done {
            return Ok(None);
        }
        let mut buf = vec![0u8; 16384];
        match &mut self.framing {
            Framing::Length(left) => {
                if *left == 0 {
                    self.done = true;
                    return Ok(None);
                }
                let n = (*left).min(buf.len());
                let got = self.reader.read(&mut buf[..n])?;
                if got == 0 {
                    return Err(bad("the connection closed before Content-Length bytes"));
                }
                *left -= got;
                buf.truncate(got);
                Ok(Some(buf))
            }
            Framing::UntilClose => {
                let got = self.reader.read(&mut buf)?;
                if got == 0 {
                    self.done = true;
                    return Ok(None);
                }
                buf.truncate(got);
                Ok(Some(buf))
            }
            Framing::Chunked { left } => {
                if *left == 0 {
                    let mut line = String::new();
                    if self.reader.read_line(&mut line)? == 0 {
                        return Err(bad("the connection closed inside a chunked body"));
                    }
                    let size = line.trim().split(';').next().unwrap_or("");
                    let size = usize::from_str_radix(size, 16)
                        .map_err(|_| bad(format!("bad chunk size line {line:?}")))?;
                    if size == 0 {
                        // Trailers, then the blank line that ends the body.
                        loop {
                            line.clear();
                            if self.reader.read_line(&mut line)? == 0 || line.trim().is_empty() {
                                break;
                            }
                        }
                        self.done = true;
                        return Ok(None);
                    }
                    *left = size;
                }
                let n = (*left).min(buf.len());
                let got = self.reader.read(&mut buf[..n])?;
                if got == 0 {
                    return Err(bad("the connection closed inside a chunk"));
                }
                *left -= got;
                if *left == 0 {
                    let mut crlf = [0u8; 2];
                    self.reader.read_exact(&mut crlf)?;
                }
                buf.truncate(got);
                Ok(Some(buf))
            }
        }
    }

    pub fn read_all(mut self) -> io::Result<Response> {
        let mut body = Vec::new();
        while let Some(piece) = self.read_some()? {
            body.extend_from_slice(&piece);
        }
        Ok(Response {
            status: self.status,
            headers: self.headers,
            body,
        })
    }

    /// Reads server-sent events one at a time.
    pub fn events(self) -> Events {
        Events {
            conn: self,
            buf: Vec::new(),
        }
    }
}

pub fn request(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> io::Result<Response> {
    send(addr, method, path, headers, body)?.read_all()
}

pub struct Events {
    pub conn: Conn,
    buf: Vec<u8>,
}

impl Events {
    /// The next event block (its lines, without the blank line that ends it); `None` at the end.
    pub fn next_event(&mut self) -> io::Result<Option<String>> {
        loop {
            if let Some(i) = self.buf.windows(2).position(|w| w == b"\n\n") {
                let block: Vec<u8> = self.buf.drain(..i + 2).collect();
                return Ok(Some(String::from_utf8_lossy(&block[..i]).into_owned()));
            }
            match self.conn.read_some()? {
                Some(piece) => self.buf.extend_from_slice(&piece),
                None if self.buf.iter().all(u8::is_ascii_whitespace) => return Ok(None),
                None => return Err(bad("the stream ended inside an event")),
            }
        }
    }
}
