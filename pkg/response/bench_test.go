package response

import (
	"strings"
	"testing"

	"github.com/pd-extproc/pd-extproc/internal/enginetest"
)

// BenchmarkRewriter is the rewriter's own cost per piece of an answer: a
// streamed token event (what almost every chunk is), the final usage event it
// fixes, a token event cut in two, and a whole non-streamed answer. make bench
// measures the same through gRPC against plain pass-through (docs/benchmarks.md).
func BenchmarkRewriter(b *testing.B) {
	long := strings.Replace(chatJSON, "tok0 tok1", strings.Repeat("tok ", 1000), 1) // ~4 KiB
	cases := []struct {
		name    string
		headers headers
		chunks  []string
	}{
		{"token event", sseOK, []string{tok1}},
		{"usage event", sseOK, []string{usageEv}},
		{"token event in two chunks", sseOK, []string{tok1[:40], tok1[40:]}},
		{"JSON answer 4KiB", jsonOK, []string{long}},
	}
	for _, c := range cases {
		chunks := make([][]byte, len(c.chunks))
		n := 0
		for i, s := range c.chunks {
			chunks[i] = []byte(s)
			n += len(s)
		}
		b.Run(c.name, func(b *testing.B) {
			b.SetBytes(int64(n))
			b.ReportAllocs()
			r := New(chatPath, []byte("8"), nil, 1<<20)
			r.Start(c.headers.status, c.headers.contentType, "")
			last := c.headers == jsonOK // a JSON answer ends with its chunk; a stream goes on
			for b.Loop() {
				for _, ch := range chunks {
					if out := r.Body(ch, last); out.Len() == 0 && last {
						b.Fatal("nothing let through")
					}
				}
			}
		})
	}
}

// BenchmarkOpening is the cost of judging a stream by its opening, once per
// streamed answer (Opening reads no further): a chat stream's role and first
// token, served; the role and vLLM's error event, failed.
func BenchmarkOpening(b *testing.B) {
	const fail = enginetest.StreamError
	for _, c := range []struct {
		name, stream string
		want         Verdict
	}{{"served", role + tok0, Served}, {"failed", role + fail, Failed}} {
		b.Run(c.name, func(b *testing.B) {
			stream := []byte(c.stream)
			b.SetBytes(int64(len(stream)))
			b.ReportAllocs()
			for b.Loop() {
				if NewOpening(1, 1).Scan(stream) != c.want {
					b.Fatal("wrong verdict")
				}
			}
		})
	}
}
