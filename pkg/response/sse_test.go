package response

import (
	"strings"
	"testing"
)

// The WHATWG server-sent events framing a client reads: lines end in CRLF,
// LF or CR; a blank line ends an event; "data:" with or without one space;
// comment lines (":") and other fields are not data, a bare "data" line is an
// empty one; one byte order mark at the stream's start is skipped, and only
// there; an event the stream does not end is none.
// Each stream is fed cut at every position (and once whole): the rewriter's
// bytes, the reader's number and the openings' verdicts must not depend on
// the cut, and StreamFailed reads the whole stream as they do.
func TestEventStreamFramingAsAClientReadsIt(t *testing.T) {
	const bom = "\ufeff"
	crlf := func(s string) string { return strings.ReplaceAll(s, "\n", "\r\n") }
	cr := func(s string) string { return strings.ReplaceAll(s, "\n", "\r") }
	// crBlank ends an event's blank line with CR alone after lines ended by end.
	crBlank := func(s, end string) string {
		return strings.ReplaceAll(strings.ReplaceAll(s, "\n\n", "\n\r"), "\n", end)
	}
	noSpace := func(s string) string { return strings.ReplaceAll(s, "data: ", "data:") }
	comment := ": \"cached_tokens\":12 ping\n"
	// split cuts an event's data in two lines, which a client joins with LF.
	split := func(ev, at, lead string) string { return strings.Replace(ev, at, at+"\n"+lead, 1) }
	abort := sglangChunk(`""`, `[]`, `{"type":"abort","message":"x","status_code":500}`)
	tests := []struct {
		name, in, want string
		read           string  // what a reader reads of the number; "" for nothing
		verdict        Verdict // of NewOpening(1, 1)
		generate       Verdict // of NewGenerateOpening(1)
		failed         bool    // StreamFailed
	}{
		{"LF", role + tok0 + usageEv + done, role + tok0 + fixedEv + done, "12", Served, Served, false},
		{"CRLF", crlf(role + tok0 + usageEv + done), crlf(role + tok0 + fixedEv + done), "12", Served, Served, false},
		{"CR", cr(role + tok0 + usageEv + done), cr(role + tok0 + fixedEv + done), "12", Served, Served, false},
		{"mixed line ends", role + crlf(tok0) + cr(usageEv) + done, role + crlf(tok0) + cr(fixedEv) + done, "12", Served, Served, false},
		{"data: without its space", noSpace(role + tok0 + usageEv + done), noSpace(role + tok0 + fixedEv + done), "12", Served, Served, false},
		{"comments and other fields", comment + "event: x\n" + role + comment + tok0 + "id: 3\n" + comment + usageEv + done,
			comment + "event: x\n" + role + comment + tok0 + "id: 3\n" + comment + fixedEv + done, "12", Served, Served, false},
		{"a leading BOM", bom + usageEv + done, bom + fixedEv + done, "12", Served, Served, false},
		{"a leading BOM, then an error event", bom + errorEv + done, bom + errorEv + done, "", Failed, Failed, true},
		{"a leading BOM, CRLF", crlf(bom + role + tok0 + usageEv), crlf(bom + role + tok0 + fixedEv), "12", Served, Pending, false},
		{"a usage event on two data lines", role + split(usageEv, `"choices":[],`, "data: ") + done,
			role + split(fixedEv, `"choices":[],`, "data: ") + done, "12", Served, Served, false},
		{"a usage event on three data lines, CRLF", crlf(role + split(split(usageEv, `"choices":[],`, "data: "), `"prompt_tokens_details":`, "data:") + done),
			crlf(role + split(split(fixedEv, `"choices":[],`, "data: "), `"prompt_tokens_details":`, "data:") + done), "12", Served, Served, false},
		{"usage, then an error event on two data lines: the reader reads nothing", tok0 + usageEv + split(errorEv, `{"error":`, "data: ") + done,
			tok0 + fixedEv + split(errorEv, `{"error":`, "data: ") + done, "", Served, Failed, false},
		{"an error event on two data lines", "data: {\"error\":\ndata: {\"code\":503}}\n\n" + done, "data: {\"error\":\ndata: {\"code\":503}}\n\n" + done, "", Failed, Failed, true},
		// A client reads an event's end where a line ended by LF or CRLF
		// is followed by a CR alone.
		{"LF lines, CR blank lines", crBlank(role+tok0+usageEv, "\n") + done, crBlank(role+tok0+fixedEv, "\n") + done, "12", Served, Served, false},
		{"CRLF lines, CR blank lines", crBlank(role+tok0+usageEv+done, "\r\n"), crBlank(role+tok0+fixedEv+done, "\r\n"), "12", Served, Served, false},
		{"LF lines, CR blank lines, an error event", crBlank(role+errorEv+done, "\n"), crBlank(role+errorEv+done, "\n"), "", Failed, Failed, true},
		// SGLang's /generate abort (TestGenerateOpeningTellsAnAbortFromTheFirstToken).
		{"an abort", abort + done, abort + done, "", Served, Failed, true},
		{"an abort, CR", cr(abort + done), cr(abort + done), "", Served, Failed, true},
		{"an abort on two data lines", split(abort, `"meta_info":`, "data: ") + done, split(abort, `"meta_info":`, "data: ") + done, "", Served, Failed, true},
		{"an abort the stream does not end", strings.TrimSuffix(abort, "\n"), strings.TrimSuffix(abort, "\n"), "", Pending, Pending, false},
		{"a data line before the abort's makes one event that is no JSON", "data: {}\n" + abort + done, "data: {}\n" + abort + done, "", Served, Served, false},
		// A byte order mark anywhere but at the stream's start is part of
		// its line: "\ufeffdata" is a field a client ignores.
		{"a BOM after the stream's start: no error event", role + bom + errorEv + done, role + bom + errorEv + done, "", Served, Served, false},
		{"a BOM after the stream's start: no usage", role + tok0 + bom + usageEv + done, role + tok0 + bom + usageEv + done, "", Served, Served, false},
		{"a BOM on the first event's second line", bom + "id: 1\n" + bom + errorEv + done, bom + "id: 1\n" + bom + errorEv + done, "", Pending, Served, false},
		{"two BOMs at the start", bom + bom + errorEv + done, bom + bom + errorEv + done, "", Pending, Served, false},
		// A bare "data" line adds an empty line to the data; a client's JSON
		// parser skips the white space it makes, as it does spaces after "data: ".
		{"a bare data line before an error event", role + "data\n" + errorEv + done, role + "data\n" + errorEv + done, "", Failed, Failed, true},
		{"a bare data line before an abort", "data\n" + abort + done, "data\n" + abort + done, "", Served, Failed, true},
		{"bare data lines in a usage event", role + strings.Replace(split(usageEv, `"choices":[],`, "data\ndata: "), "\n\n", "\ndata\n\n", 1) + done,
			role + strings.Replace(split(fixedEv, `"choices":[],`, "data\ndata: "), "\n\n", "\ndata\n\n", 1) + done, "12", Served, Served, false},
		{"an error event with two spaces after its colon", role + strings.Replace(errorEv, "data: ", "data:  ", 1) + done,
			role + strings.Replace(errorEv, "data: ", "data:  ", 1) + done, "", Failed, Failed, true},
		// An event the stream does not end with a blank line is none: its
		// bytes pass as they came and a reader reads nothing of it.
		{"a usage event the stream does not end", role + tok0 + strings.TrimSuffix(usageEv, "\n"), role + tok0 + strings.TrimSuffix(usageEv, "\n"), "", Served, Pending, false},
		{"a usage event cut in its line at the stream's end", role + tok0 + usageEv[:len(usageEv)-2], role + tok0 + usageEv[:len(usageEv)-2], "", Served, Pending, false},
		{"usage, then an error event the stream does not end", tok0 + usageEv + strings.TrimSuffix(errorEv, "\n"),
			tok0 + fixedEv + strings.TrimSuffix(errorEv, "\n"), "12", Served, Pending, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if StreamFailed([]byte(tt.in)) != tt.failed {
				t.Errorf("StreamFailed = %v, want %v", !tt.failed, tt.failed)
			}
			for cut := 0; cut <= len(tt.in); cut++ {
				chunks := []string{tt.in[:cut], tt.in[cut:]}
				w := New(chatPath, []byte("8"), nil, 1<<20)
				w.Start(200, "text/event-stream", "")
				var read string
				rd := NewReader(chatPath, 1<<20, func(raw []byte, stated bool) {
					if stated {
						read = string(raw)
					}
				})
				rd.Start(200, "text/event-stream", "")
				var got strings.Builder
				o, g := NewOpening(1, 1), NewGenerateOpening(1)
				for i, c := range chunks {
					for _, piece := range w.Body([]byte(c), i == len(chunks)-1) {
						got.Write(piece)
					}
					rd.Body([]byte(c), i == len(chunks)-1)
					o.Scan([]byte(c))
					g.Scan([]byte(c))
				}
				if got.String() != tt.want {
					t.Fatalf("cut at %d: the client gets\n%q\nwant\n%q", cut, got.String(), tt.want)
				}
				if read != tt.read {
					t.Fatalf("cut at %d: the reader read %q, want %q", cut, read, tt.read)
				}
				if o.Verdict() != tt.verdict {
					t.Fatalf("cut at %d: verdict %v, want %v", cut, o.Verdict(), tt.verdict)
				}
				if g.Verdict() != tt.generate {
					t.Fatalf("cut at %d: /generate verdict %v, want %v", cut, g.Verdict(), tt.generate)
				}
			}
		})
	}
}

// TestEventDataIsWhatAClientReads: an event's data is its data lines' values
// joined by LF, as the WHATWG spec's "Interpreting an event stream" and the
// OpenAI Python SDK's SSEDecoder (src/openai/_streaming.py) read them.
func TestEventDataIsWhatAClientReads(t *testing.T) {
	tests := []struct{ name, ev, want string }{
		{"one line", "data: x\n\n", "x"},
		{"no space", "data:x\n\n", "x"},
		{"two spaces: one is the value's", "data:  x\n\n", " x"},
		{"two lines", "data: x\ndata:y\n\n", "x\ny"},
		{"an empty value", "data: x\ndata:\ndata: y\n\n", "x\n\ny"},
		{"a bare data line after", "data: x\ndata\n\n", "x\n"},
		{"a bare data line before", "data\ndata: x\n\n", "\nx"},
		{"a bare data line, CRLF", "data: x\r\ndata\r\n\r\n", "x\n"},
		{"a bare data line, CR", "data\rdata: x\r\r", "\nx"},
		{"other fields and comments", "event: e\nid: 1\nretry: 5\n: data: c\ndata: x\n\n", "x"},
		{"a BOM makes another field", "\ufeffdata: x\n\n", ""},
		{"a space before the colon makes another field", "data : x\n\n", ""},
		{"field names are case-sensitive", "Data: x\n\n", ""},
		{"a longer name", "datum: x\ndatax\n\n", ""},
	}
	for _, tt := range tests {
		if got, _ := eventData([]byte(tt.ev)); string(got) != tt.want {
			t.Errorf("%s: %q has data %q, want %q", tt.name, tt.ev, got, tt.want)
		}
	}
}
