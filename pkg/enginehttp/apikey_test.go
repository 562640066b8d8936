package enginehttp

import (
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// A key file that cannot serve is refused at start, naming its config key.
func TestAPIKeyFileIsCheckedAtStart(t *testing.T) {
	dir := t.TempDir()
	write := func(name, content string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	tests := []struct {
		name, path, want, wantErr string
	}{
		{"a Secret's key, with its newline", write("key", "sk-engine\n"), "Bearer sk-engine", ""},
		{"no file", filepath.Join(dir, "none"), "", "no such file"},
		{"empty", write("empty", " \n"), "", "holds no key"},
		{"two lines", write("lines", "sk-a\nsk-b\n"), "", "control character"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			k, err := APIKey("pools.decode.api_key_file", tc.path)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) || !strings.HasPrefix(err.Error(), "pools.decode.api_key_file: ") {
					t.Fatalf("err %v, want one naming the key and %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := k.Authorization(); got != tc.want {
				t.Errorf("Authorization %q, want %q", got, tc.want)
			}
		})
	}
	if k, err := APIKey("prefill.api_key_file", ""); k != nil || err != nil {
		t.Errorf("no file named: %v, %v; want no key", k, err)
	}
}

// Every request of a keyed client reaches the engine with the key in place
// of the Authorization it was given (the client's, forwarded), the key as
// the file holds it now: a rotated Secret needs no restart, and a rotation
// half written keeps the key read before.
func TestAKeyedClientSendsTheKeyOfTheFileAsItIsNow(t *testing.T) {
	seen := make(chan string, 1)
	engine := httptest.NewServer(http.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) { seen <- r.Header.Get("Authorization") }))
	defer engine.Close()
	path := filepath.Join(t.TempDir(), "key")
	rotate := func(content string, at time.Time) {
		t.Helper()
		if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Chtimes(path, at, at); err != nil {
			t.Fatal(err)
		}
	}
	start := time.Now()
	rotate("sk-1", start)
	k, err := APIKey("prefill.api_key_file", path)
	if err != nil {
		t.Fatal(err)
	}
	c := k.Client(&http.Client{})
	steps := []struct {
		name, rotateTo string
		want           string
	}{
		{"as read at start", "", "Bearer sk-1"},
		{"rotated", "sk-2\n", "Bearer sk-2"},
		{"half written", "", "Bearer sk-2"},
	}
	for i, st := range steps {
		switch {
		case st.name == "half written":
			rotate("", start.Add(time.Duration(i)*time.Minute))
		case st.rotateTo != "":
			rotate(st.rotateTo, start.Add(time.Duration(i)*time.Minute))
		}
		req, _ := http.NewRequest(http.MethodGet, engine.URL+"/v1/models", nil)
		req.Header.Set("Authorization", "Bearer client-key")
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if got := <-seen; got != st.want {
			t.Errorf("%s: the engine saw %q, want %q", st.name, got, st.want)
		}
		if got := req.Header.Get("Authorization"); got != "Bearer client-key" {
			t.Errorf("%s: the caller's request was changed: %q", st.name, got)
		}
	}
	var none *Key
	if none.Client(c) != c {
		t.Error("no key: want the client itself")
	}
}

// A keyed client closes its idle connections when asked, as the client it
// wraps does: the pools close theirs when they stop probing the engines
// (Pools.Run), and with an API key the keep-alive connections, and their
// goroutines, stayed open to the engines.
func TestAKeyedClientClosesItsIdleConnections(t *testing.T) {
	path := filepath.Join(t.TempDir(), "key")
	if err := os.WriteFile(path, []byte("sk-1"), 0o600); err != nil {
		t.Fatal(err)
	}
	k, err := APIKey("pools.decode.api_key_file", path)
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name string
		key  *Key
	}{
		{"no key", nil},
		{"keyed", k},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var dialled atomic.Int32
			engine := httptest.NewUnstartedServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
			engine.Config.ConnState = func(_ net.Conn, s http.ConnState) {
				if s == http.StateNew {
					dialled.Add(1)
				}
			}
			engine.Start()
			defer engine.Close()
			c := tt.key.Client(&http.Client{Transport: &http.Transport{}})
			for range 2 {
				resp, err := c.Get(engine.URL)
				if err != nil {
					t.Fatal(err)
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				c.CloseIdleConnections()
			}
			if n := dialled.Load(); n != 2 {
				t.Errorf("%d connections for two requests with CloseIdleConnections between them; want 2: the idle one stayed open", n)
			}
		})
	}
}
